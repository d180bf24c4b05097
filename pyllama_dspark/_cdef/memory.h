// Source: include/llama.h (llama.cpp 0c1e57098 + pyllama-dspark patches).

void llama_memory_clear(
        llama_memory_t mem,
                  bool data);
bool llama_memory_seq_rm(
        llama_memory_t mem,
          llama_seq_id seq_id,
             llama_pos p0,
             llama_pos p1);
void llama_memory_seq_cp(
        llama_memory_t mem,
          llama_seq_id seq_id_src,
          llama_seq_id seq_id_dst,
             llama_pos p0,
             llama_pos p1);
llama_pos llama_memory_seq_pos_min(
        llama_memory_t mem,
          llama_seq_id seq_id);
llama_pos llama_memory_seq_pos_max(
        llama_memory_t mem,
          llama_seq_id seq_id);
