// Source: ggml/include/ggml.h, ggml/include/ggml-cpu.h, include/llama.h (llama.cpp 0c1e57098 + pyllama-dspark patches).

struct ggml_threadpool_params {
    int                 n_threads;
    uint32_t            poll;
    ...;
};

struct ggml_threadpool;

typedef struct ggml_threadpool * ggml_threadpool_t;

struct ggml_threadpool_params ggml_threadpool_params_default(int n_threads);
struct ggml_threadpool *      ggml_threadpool_new           (struct ggml_threadpool_params  * params);
void                          ggml_threadpool_free          (struct ggml_threadpool * threadpool);
void llama_attach_threadpool(
        struct llama_context * ctx,
           ggml_threadpool_t   threadpool,
           ggml_threadpool_t   threadpool_batch);

// pyllama-dspark (patch 0008): mul_mat chunks computed with the two-column dot kernels so far
int64_t ggml_cpu_dspark_x2_chunks(void);
// pyllama-dspark (patch 0014): small-batch products tinyBLAS computed under consistent numerics so far
int64_t ggml_cpu_dspark_consistent_sgemm_matrices(void);
// pyllama-dspark (patch 0024): consistent-numerics flash attention shares each KV chunk between the rows and
// heads that read it; false selects patch 0013's per-row path (measurements). Returns the previous setting
bool ggml_cpu_dspark_set_shared_attention(bool enabled);
// pyllama-dspark (patch 0024): flash-attention ops the shared-KV path computed so far
int64_t ggml_cpu_dspark_shared_attention_ops(void);
