// Source: include/llama.h (llama.cpp 0c1e57098 + pyllama-dspark patches).

struct llama_model_params          llama_model_default_params(void);
struct llama_context_params        llama_context_default_params(void);
void llama_backend_init(void);
void llama_log_set(ggml_log_callback   log_callback, void *  user_data);
const char * llama_print_system_info(void);
bool llama_supports_gpu_offload(void);
