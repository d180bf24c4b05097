// Source: include/llama.h (llama.cpp 0c1e57098 + pyllama-dspark patches).

struct llama_context * llama_init_from_model(
                 struct llama_model * model,
        struct llama_context_params   params);
void llama_free(struct llama_context * ctx);
uint32_t llama_n_ctx      (const struct llama_context * ctx);
uint32_t llama_n_ctx_seq  (const struct llama_context * ctx);
uint32_t llama_n_batch    (const struct llama_context * ctx);
uint32_t llama_n_ubatch   (const struct llama_context * ctx);
uint32_t llama_n_seq_max  (const struct llama_context * ctx);
uint32_t llama_n_rs_seq   (const struct llama_context * ctx);
llama_memory_t   llama_get_memory  (const struct llama_context * ctx);
int32_t llama_decode(
        struct llama_context * ctx,
          struct llama_batch   batch);
void llama_set_n_threads(struct llama_context * ctx, int32_t n_threads, int32_t n_threads_batch);
void llama_set_abort_callback(struct llama_context * ctx, ggml_abort_callback abort_callback, void * abort_callback_data);
void llama_synchronize(struct llama_context * ctx);
float * llama_get_logits(struct llama_context * ctx);
float * llama_get_logits_ith(struct llama_context * ctx, int32_t i);
void llama_set_causal_attn(struct llama_context * ctx, bool causal_attn);
size_t llama_state_seq_get_size(
        struct llama_context * ctx,
                llama_seq_id   seq_id);
size_t llama_state_seq_get_data(
        struct llama_context * ctx,
                     uint8_t * dst,
                      size_t   size,
                llama_seq_id   seq_id);
size_t llama_state_seq_set_data(
        struct llama_context * ctx,
               const uint8_t * src,
                      size_t   size,
                llama_seq_id   dest_seq_id);
