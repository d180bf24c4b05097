// Source: include/llama-dspark.h (pyllama-dspark patch series on llama.cpp 0c1e57098).

const char * llama_dspark_build_info(void);
int32_t llama_dspark_model_n_target_layers(const struct llama_model * model);
int32_t llama_dspark_model_target_layers(const struct llama_model * model, int32_t * out, int32_t n_max);
struct llama_context * llama_dspark_get_ctx_other(struct llama_context * ctx);
int32_t llama_dspark_set_embeddings_layer_inp(struct llama_context * ctx, int32_t lid, bool value);
float * llama_dspark_get_embeddings_layer_inp(struct llama_context * ctx, int32_t lid);

enum llama_dspark_capture_status {
    LLAMA_DSPARK_CAPTURE_OK                =  0,
    LLAMA_DSPARK_CAPTURE_ERR_LAYER_RANGE   = -1,
    LLAMA_DSPARK_CAPTURE_ERR_DUPLICATE     = -2,
    LLAMA_DSPARK_CAPTURE_ERR_TOO_MANY      = -3,
    LLAMA_DSPARK_CAPTURE_ERR_ARCH          = -4,
    LLAMA_DSPARK_CAPTURE_ERR_NULL          = -5,
    LLAMA_DSPARK_CAPTURE_ERR_CONTEXT_TYPE  = -6,
    LLAMA_DSPARK_CAPTURE_ERR_DENSE_LAST    = -7,
};

#define LLAMA_DSPARK_MAX_CAPTURE_LAYERS 64

int32_t llama_set_capture_layers(struct llama_context * ctx, const int32_t * layer_ids, int32_t n, bool masked);
int32_t llama_get_n_capture(const struct llama_context * ctx);
int32_t llama_get_capture_n_rows(struct llama_context * ctx);
float * llama_get_embeddings_capture(struct llama_context * ctx);
float * llama_get_embeddings_capture_ith(struct llama_context * ctx, int32_t i);
int32_t llama_dspark_set_narrowing(struct llama_context * ctx, bool enabled);
int32_t llama_dspark_set_embeddings_nextn(struct llama_context * ctx, bool value, bool masked);
float * llama_dspark_get_embeddings_nextn_ith(struct llama_context * ctx, int32_t i);
int32_t llama_dspark_set_consistent_numerics(struct llama_context * ctx, bool enabled);

int32_t llama_dspark_remote_failed(struct llama_context * ctx);
