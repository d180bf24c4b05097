// Source: include/llama.h, ggml/include/ggml-backend.h, ggml/include/ggml-rpc.h (llama.cpp 0c1e57098 + pyllama-dspark patches).

struct llama_model_params          llama_model_default_params(void);
struct llama_context_params        llama_context_default_params(void);
void llama_backend_init(void);
void llama_log_set(ggml_log_callback   log_callback, void *  user_data);
const char * llama_print_system_info(void);
bool llama_supports_gpu_offload(void);
size_t llama_max_devices(void);

// devices and registries (the RPC backend's functions are reached through its registry's proc addresses, so
// this extension links and runs in builds without it)
size_t                     ggml_backend_dev_count(void);
ggml_backend_dev_t         ggml_backend_dev_get(size_t index);
const char *               ggml_backend_dev_name(ggml_backend_dev_t device);
enum ggml_backend_dev_type ggml_backend_dev_type(ggml_backend_dev_t device);
ggml_backend_reg_t         ggml_backend_reg_by_name(const char * name);
size_t                     ggml_backend_reg_dev_count(ggml_backend_reg_t reg);
ggml_backend_dev_t         ggml_backend_reg_dev_get(ggml_backend_reg_t reg, size_t index);
void *                     ggml_backend_reg_get_proc_address(ggml_backend_reg_t reg, const char * name);

#define RPC_PROTO_MAJOR_VERSION ...
#define RPC_PROTO_MINOR_VERSION ...
