// The extension's Python entry points; each kernel lives in its own file.
#include <torch/extension.h>

void paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                     torch::Tensor starts, torch::Tensor row_lens, torch::Tensor seqs, double scale,
                     torch::Tensor out);
bool paged_attention_uses_amx();
int64_t paged_attention_chunk_rows();
void paged_attention_set_amx(bool on);
std::string paged_attention_chunk_path();
void paged_attention_set_dpbf16(bool on);
bool linear_vnni_available();
torch::Tensor linear_vnni_pack(torch::Tensor weight);
void step_attention_begin(torch::Tensor kv_cache, torch::Tensor write_rows, torch::Tensor write_slots,
                          torch::Tensor tables, torch::Tensor starts, torch::Tensor row_lens, torch::Tensor seqs,
                          double scale, int64_t rows);
void step_attention_end();
void residual_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k_res,
                        torch::Tensor v_res, torch::Tensor b_k, torch::Tensor b_v, torch::Tensor lora_scales,
                        torch::Tensor rope_cos, torch::Tensor rope_sin, torch::Tensor tables, torch::Tensor res_tables,
                        torch::Tensor starts, torch::Tensor row_lens, torch::Tensor seq_adapter, torch::Tensor seqs,
                        double scale, torch::Tensor out);
torch::Tensor pointwise_rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
std::tuple<torch::Tensor, torch::Tensor> pointwise_add_rms_norm(torch::Tensor h, torch::Tensor delta,
                                                                torch::Tensor weight, double eps);
std::tuple<torch::Tensor, torch::Tensor> pointwise_rope(torch::Tensor q, torch::Tensor k, torch::Tensor cos,
                                                        torch::Tensor sin);
torch::Tensor pointwise_silu_mul(torch::Tensor gate_up, int64_t inter);
torch::Tensor int4_expand(torch::Tensor packed, torch::Tensor scales_zeros, int64_t group, int64_t block_n);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention);
  m.def("paged_attention_uses_amx", &paged_attention_uses_amx);
  m.def("paged_attention_chunk_rows", &paged_attention_chunk_rows);
  m.def("paged_attention_set_amx", &paged_attention_set_amx);
  m.def("paged_attention_chunk_path", &paged_attention_chunk_path);
  m.def("paged_attention_set_dpbf16", &paged_attention_set_dpbf16);
  m.def("step_attention_begin", &step_attention_begin);
  m.def("step_attention_end", &step_attention_end);
  m.def("residual_attention", &residual_attention);
  m.def("int4_expand", &int4_expand);
  m.def("pointwise_rms_norm", &pointwise_rms_norm);
  m.def("pointwise_add_rms_norm", &pointwise_add_rms_norm);
  m.def("pointwise_rope", &pointwise_rope);
  m.def("pointwise_silu_mul", &pointwise_silu_mul);
  m.def("linear_vnni_available", &linear_vnni_available);
  m.def("linear_vnni_pack", &linear_vnni_pack);
}
