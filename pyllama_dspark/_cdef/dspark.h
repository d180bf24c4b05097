// Source: include/llama-dspark.h (pyllama-dspark patch series on llama.cpp 0c1e57098).

const char * llama_dspark_build_info(void);
int32_t llama_dspark_model_n_target_layers(const struct llama_model * model);
int32_t llama_dspark_model_target_layers(const struct llama_model * model, int32_t * out, int32_t n_max);
struct llama_context * llama_dspark_get_ctx_other(struct llama_context * ctx);
int32_t llama_dspark_set_embeddings_layer_inp(struct llama_context * ctx, int32_t lid, bool value);
float * llama_dspark_get_embeddings_layer_inp(struct llama_context * ctx, int32_t lid);
