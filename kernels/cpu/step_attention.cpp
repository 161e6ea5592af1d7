// One layer's KV write and paged attention of a compiled CPU step, as the torch op
// `kvshare::step_attention_cpu` that the step's graph calls once per layer.
//
// Why: the graph's other attention op (`kvshare::step_attention`, kvshare/serve/compiled.py) is
// defined in Python; each call went through the Python op dispatcher, the step's context and two
// index_copy_ calls before this extension's kernel ran. Measured on 2 vCPUs of an AMX Xeon,
// SmolLM2 int4, batch-1 decode at 16 tokens of context: 41 us a layer in Python around a 13 us
// kernel, 1.2 ms of a 10 ms step. Here the step's plan (the rows it writes, their slots, the
// kernel's index tensors) is handed over once per step (`step_attention_begin`) and kept per
// thread (engines step on their own threads); each layer's call writes its rows' K/V by their
// slots and runs `paged_attention` over that layer's views of the block-major cache.
#include <torch/extension.h>

#include <cstring>

void paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                     torch::Tensor starts, torch::Tensor row_lens, torch::Tensor seqs, double scale,
                     torch::Tensor out);

namespace {

struct StepPlan {
  bool active = false;
  torch::Tensor kv_cache;     // (blocks, layers, 2, block_size, kv_heads, d)
  torch::Tensor write_rows;   // int64: the rows of k/v that write
  torch::Tensor write_slots;  // int64: their flat slots (block * block_size + offset); -1 writes nothing
  torch::Tensor tables, starts, row_lens, seqs;  // paged_attention's index tensors
  double scale = 1.0;
  int64_t rows = 0;  // real rows; those after them are pad rows (zeros out)
};

thread_local StepPlan plan;

// Copy each writing row of `src` (rows, kv_heads, d) into slot `slot` of `cache` (blocks,
// block_size, kv_heads, d; a layer's K or V view)
void write_rows(const torch::Tensor& src, const torch::Tensor& cache) {
  const int64_t n = plan.write_rows.numel();
  if (n == 0) return;
  TORCH_CHECK(src.scalar_type() == cache.scalar_type(), "step_attention_cpu: K/V and the cache differ in dtype");
  TORCH_CHECK(src.dim() == 3 && src.size(1) == cache.size(2) && src.size(2) == cache.size(3) && src.stride(2) == 1,
              "step_attention_cpu: K/V rows (rows, kv_heads, d) with a contiguous last dim");
  const int64_t block_size = cache.size(1), blocks = cache.size(0), heads = cache.size(2), d = cache.size(3);
  const int64_t item = src.element_size(), bytes = d * item;
  const auto* rows = plan.write_rows.data_ptr<int64_t>();
  const auto* slots = plan.write_slots.data_ptr<int64_t>();
  const char* from = static_cast<const char*>(src.data_ptr());
  char* to = static_cast<char*>(cache.data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = rows[i], slot = slots[i];
    if (slot < 0) continue;
    TORCH_CHECK(row >= 0 && row < src.size(0) && slot < blocks * block_size, "step_attention_cpu: a write out of range");
    const int64_t block = slot / block_size, offset = slot % block_size;
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(to + (block * cache.stride(0) + offset * cache.stride(1) + h * cache.stride(2)) * item,
                  from + (row * src.stride(0) + h * src.stride(1)) * item, bytes);
  }
}

}  // namespace

// Hand over a step's plan (kept until `step_attention_end`, on this thread)
void step_attention_begin(torch::Tensor kv_cache, torch::Tensor write_rows_, torch::Tensor write_slots,
                          torch::Tensor tables, torch::Tensor starts, torch::Tensor row_lens, torch::Tensor seqs,
                          double scale, int64_t rows) {
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(2) == 2 && kv_cache.stride(5) == 1,
              "kv_cache: (blocks, layers, 2, block_size, kv_heads, d) with a contiguous last dim");
  TORCH_CHECK(write_rows_.scalar_type() == torch::kInt64 && write_slots.scalar_type() == torch::kInt64 &&
                  write_rows_.is_contiguous() && write_slots.is_contiguous() &&
                  write_rows_.numel() == write_slots.numel(),
              "write rows and slots: contiguous int64, one slot per row");
  plan = StepPlan{true, kv_cache, write_rows_, write_slots, tables, starts, row_lens, seqs, scale, rows};
}

void step_attention_end() { plan = StepPlan{}; }

torch::Tensor step_attention_cpu(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t layer) {
  TORCH_CHECK(plan.active, "kvshare::step_attention_cpu runs inside a compiled step only");
  TORCH_CHECK(layer >= 0 && layer < plan.kv_cache.size(1), "step_attention_cpu: no layer ", layer);
  auto layer_kv = plan.kv_cache.select(1, layer);
  auto k_cache = layer_kv.select(1, 0), v_cache = layer_kv.select(1, 1);
  write_rows(k, k_cache);
  write_rows(v, v_cache);
  auto out = plan.rows < q.size(0) ? torch::zeros_like(q) : torch::empty_like(q);
  if (plan.seqs.numel())
    paged_attention(q, k_cache, v_cache, plan.tables, plan.starts, plan.row_lens, plan.seqs, plan.scale, out);
  return out;
}

TORCH_LIBRARY_FRAGMENT(kvshare, m) { m.def("step_attention_cpu(Tensor q, Tensor k, Tensor v, int layer) -> Tensor"); }

TORCH_LIBRARY_IMPL(kvshare, CPU, m) { m.impl("step_attention_cpu", &step_attention_cpu); }
