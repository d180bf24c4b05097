// Source: include/llama.h, ggml/include/ggml.h (llama.cpp 0c1e57098 + pyllama-dspark patches).
// Verbatim declarations; `...` lets the compiler fill in what we do not name.

typedef int32_t llama_pos;
typedef int32_t llama_token;
typedef int32_t llama_seq_id;

struct llama_vocab;
struct llama_model;
struct llama_context;
typedef struct llama_memory_i * llama_memory_t;

enum ggml_log_level {
    GGML_LOG_LEVEL_NONE  = 0,
    GGML_LOG_LEVEL_DEBUG = 1,
    GGML_LOG_LEVEL_INFO  = 2,
    GGML_LOG_LEVEL_WARN  = 3,
    GGML_LOG_LEVEL_ERROR = 4,
    GGML_LOG_LEVEL_CONT  = 5,
};

enum ggml_type {
    GGML_TYPE_F32     = 0,
    GGML_TYPE_F16     = 1,
    GGML_TYPE_Q8_0    = 8,
    ...
};

typedef void (*ggml_log_callback)(enum ggml_log_level level, const char * text, void * user_data);
typedef bool (*ggml_abort_callback)(void * data);

enum llama_vocab_type {
    LLAMA_VOCAB_TYPE_NONE   = 0,
    LLAMA_VOCAB_TYPE_SPM    = 1,
    LLAMA_VOCAB_TYPE_BPE    = 2,
    LLAMA_VOCAB_TYPE_WPM    = 3,
    LLAMA_VOCAB_TYPE_UGM    = 4,
    LLAMA_VOCAB_TYPE_RWKV   = 5,
    LLAMA_VOCAB_TYPE_PLAMO2 = 6,
    LLAMA_VOCAB_TYPE_TEST   = 7,
};

typedef struct llama_batch {
    int32_t n_tokens;

    llama_token  *  token;
    float        *  embd;
    llama_pos    *  pos;
    int32_t      *  n_seq_id;
    llama_seq_id ** seq_id;
    int8_t       *  logits;
} llama_batch;

typedef struct ggml_backend_reg * ggml_backend_reg_t;
typedef struct ggml_backend_device * ggml_backend_dev_t;

enum ggml_backend_dev_type {
    GGML_BACKEND_DEVICE_TYPE_CPU,
    GGML_BACKEND_DEVICE_TYPE_GPU,
    GGML_BACKEND_DEVICE_TYPE_IGPU,
    GGML_BACKEND_DEVICE_TYPE_ACCEL,
    ...
};

struct llama_model_params {
    ggml_backend_dev_t * devices;
    const float * tensor_split;
    int32_t n_gpu_layers;
    int32_t main_gpu;
    bool vocab_only;
    bool check_tensors;
    bool use_extra_bufts;
    ...;
};

enum llama_flash_attn_type {
    LLAMA_FLASH_ATTN_TYPE_AUTO     = -1,
    LLAMA_FLASH_ATTN_TYPE_DISABLED = 0,
    LLAMA_FLASH_ATTN_TYPE_ENABLED  = 1,
};

struct llama_context_params {
    uint32_t n_ctx;
    uint32_t n_batch;
    uint32_t n_ubatch;
    uint32_t n_seq_max;
    uint32_t n_rs_seq;
    int32_t  n_threads;
    int32_t  n_threads_batch;
    enum llama_flash_attn_type   flash_attn_type;
    enum ggml_type type_k;
    enum ggml_type type_v;
    bool embeddings;
    bool no_perf;
    bool swa_full;
    struct llama_context * ctx_other;
    ...;
};

enum llama_ftype {
    LLAMA_FTYPE_ALL_F32              = 0,
    LLAMA_FTYPE_MOSTLY_F16           = 1,
    LLAMA_FTYPE_MOSTLY_Q4_0          = 2,
    LLAMA_FTYPE_MOSTLY_Q4_1          = 3,
    LLAMA_FTYPE_MOSTLY_Q8_0          = 7,
    LLAMA_FTYPE_MOSTLY_Q5_0          = 8,
    LLAMA_FTYPE_MOSTLY_Q4_K_M        = 15,
    LLAMA_FTYPE_MOSTLY_BF16          = 32,
    ...
};

typedef struct llama_model_quantize_params {
    int32_t nthread;
    enum llama_ftype ftype;
    bool allow_requantize;
    bool pure;
    ...;
} llama_model_quantize_params;

typedef struct llama_chat_message {
    const char * role;
    const char * content;
} llama_chat_message;

struct llama_embd {
    const float * data;
    size_t n_rows;
    size_t n_embd;
};

struct llama_batch_ext;

enum llama_process_type {
    LLAMA_PROCESS_TYPE_ENCODE,
    LLAMA_PROCESS_TYPE_DECODE,
};
