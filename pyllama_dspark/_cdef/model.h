// Source: include/llama.h (llama.cpp 0c1e57098 + pyllama-dspark patches).

struct llama_model * llama_model_load_from_file(
                         const char * path_model,
          struct llama_model_params   params);
void llama_model_free(struct llama_model * model);
const struct llama_vocab * llama_model_get_vocab(const struct llama_model * model);
int32_t llama_model_n_ctx_train  (const struct llama_model * model);
int32_t llama_model_n_embd       (const struct llama_model * model);
int32_t llama_model_n_layer      (const struct llama_model * model);
int32_t llama_model_n_head       (const struct llama_model * model);
int32_t llama_model_n_head_kv    (const struct llama_model * model);
int32_t llama_model_meta_val_str(const struct llama_model * model, const char * key, char * buf, size_t buf_size);
int32_t llama_model_meta_count(const struct llama_model * model);
int32_t llama_model_meta_key_by_index(const struct llama_model * model, int32_t i, char * buf, size_t buf_size);
int32_t llama_model_meta_val_str_by_index(const struct llama_model * model, int32_t i, char * buf, size_t buf_size);
int32_t llama_model_desc(const struct llama_model * model, char * buf, size_t buf_size);
uint64_t llama_model_size(const struct llama_model * model);
const char * llama_model_chat_template(const struct llama_model * model, const char * name);
uint64_t llama_model_n_params(const struct llama_model * model);
bool llama_model_is_recurrent(const struct llama_model * model);
bool llama_model_is_hybrid(const struct llama_model * model);
struct llama_model_quantize_params llama_model_quantize_default_params(void);
uint32_t llama_model_quantize(
        const char * fname_inp,
        const char * fname_out,
        const llama_model_quantize_params * params);
