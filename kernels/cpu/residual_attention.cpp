// ForkKV's residual attention for a few query rows per sequence (decode rows), rebuilding each
// key where it is read instead of materialising the step's keys and values.
//
// Why our own: the torch path (kvshare.kernels.residual_attention.residual_attention_sdpa)
// rebuilds every key and value of the step, K_base + RoPE(s R_k B_k) and V_base + s R_v B_v, as
// dense tensors before SDPA: a dozen passes over a copy as large as an exact cache for every
// agent, in every layer and step, which is what ForkKV saves. Here each (sequence, KV head) task
// rebuilds one key row at a time in registers from its base row (read in place from the paged
// base pool) and its r residual values, and keeps the values at width r: the weighted sums of
// V_base and of R_v are kept apart and B_v is applied once at the end, (P R_v) B_v.
// RoPE is linear, so RoPE(B r) = cos * (B r) + sin * (rotate_half(B) r): both products are
// r axpys of a column of B (rotated once per task), then two multiplies by the key's cos/sin.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <vector>

namespace {

constexpr int64_t kGroup = 8;  // query vectors per pass over the keys
constexpr int64_t kMaxD = 256, kMaxRank = 64;

// Where a sequence's key t lies in a paged pool: (block table, block size, strides in elements)
template <typename T>
struct Paged {
  const T* base;
  const int32_t* table;
  int64_t block_size, block, token;
  inline const T* row(int64_t t) const { return base + table[t / block_size] * block + (t % block_size) * token; }
};

// One task's adapter, per KV head: s B_k columns and their rotate_half, s B_v rows (float)
struct HeadWeights {
  alignas(64) float bk[kMaxRank][kMaxD];      // bk[c][i] = s B_k[h*d + i][c]
  alignas(64) float bk_rot[kMaxRank][kMaxD];  // rotate_half of each column
  alignas(64) float bv[kMaxRank][kMaxD];      // bv[c][i] = s B_v[h*d + i][c]
};

void load_head_weights(const float* b_k, const float* b_v, float s, int64_t h, int64_t d, int64_t r, HeadWeights& w) {
  const int64_t half = d / 2;
  for (int64_t c = 0; c < r; ++c)
    for (int64_t i = 0; i < d; ++i) {
      w.bk[c][i] = s * b_k[(h * d + i) * r + c];
      w.bv[c][i] = s * b_v[(h * d + i) * r + c];
    }
  for (int64_t c = 0; c < r; ++c)
    for (int64_t i = 0; i < d; ++i) w.bk_rot[c][i] = i < half ? -w.bk[c][i + half] : w.bk[c][i - half];
}

// Key t of one KV head, rebuilt in ``row``: K_base + cos * (s B_k r_k) + sin * (rotate_half(s B_k) r_k).
// D and R compile-time where known: both sums then stay in registers over an unrolled rank loop.
template <typename T, int D, int R>
inline void rebuild_key(const T* base_row, const T* res_row, const float* cos, const float* sin, const HeadWeights& w,
                        int64_t runtime_d, int64_t runtime_r, float* row) {
  const int64_t d = D ? D : runtime_d, r = R ? R : runtime_r;
  alignas(64) float delta[D ? D : kMaxD], rot[D ? D : kMaxD];
  std::fill(delta, delta + d, 0.f);
  std::fill(rot, rot + d, 0.f);
  for (int64_t c = 0; c < r; ++c) {
    const float rc = static_cast<float>(res_row[c]);
    const float* col = w.bk[c];
    const float* col_rot = w.bk_rot[c];
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) {
      delta[i] += rc * col[i];
      rot[i] += rc * col_rot[i];
    }
  }
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) row[i] = static_cast<float>(base_row[i]) + delta[i] * cos[i] + rot[i] * sin[i];
}

struct Task {
  int64_t seq, kv_head, cost;
};

struct Call {
  int64_t heads, kv_heads, d, r, ratio;
  float scale;
};

// Every query vector of one sequence's KV head (rows x the query heads sharing it), kGroup at a time
template <typename T, int D, int R>
void attend_task(const Call& call, const T* q, int64_t q_row, int64_t q_head, const Paged<T>& kb, const Paged<T>& vb,
                 const Paged<T>& kr, const Paged<T>& vr, const float* cos_table, const float* sin_table,
                 const HeadWeights& w, int64_t first_row, int64_t rows, const int32_t* row_lens, int64_t h, T* out,
                 int64_t out_row, int64_t out_head, std::vector<float>& scores) {
  const int64_t d = D ? D : call.d, r = R ? R : call.r, ratio = call.ratio, vectors = rows * ratio;
  alignas(64) float qf[kGroup * (D ? D : kMaxD)], acc[kGroup * (D ? D : kMaxD)], acc_res[kGroup * kMaxRank];
  alignas(64) float row[D ? D : kMaxD];
  const int64_t kh = h * d;  // this head's offset in a base row of the pool
  for (int64_t first = 0; first < vectors; first += kGroup) {
    const int64_t g = std::min(kGroup, vectors - first);
    int64_t lens[kGroup], longest = 0;
    for (int64_t j = 0; j < g; ++j) {
      const int64_t rr = first_row + (first + j) / ratio, qh = h * ratio + (first + j) % ratio;
      lens[j] = row_lens[rr];
      longest = std::max(longest, lens[j]);
      const T* src = q + rr * q_row + qh * q_head;
      for (int64_t i = 0; i < d; ++i) qf[j * d + i] = static_cast<float>(src[i]) * call.scale;
    }
    if (static_cast<int64_t>(scores.size()) < g * longest) scores.resize(g * longest);
    float* sc = scores.data();
    for (int64_t t = 0; t < longest; ++t) {  // scores against each rebuilt key
      rebuild_key<T, D, R>(kb.row(t) + kh, kr.row(t), cos_table + t * d, sin_table + t * d, w, d, r, row);
      for (int64_t j = 0; j < g; ++j) {
        const float* qj = qf + j * d;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < d; ++i) dot += qj[i] * row[i];
        sc[j * longest + t] = dot;
      }
    }
    float total[kGroup];
    for (int64_t j = 0; j < g; ++j) {  // softmax over the row's own keys
      float* s = sc + j * longest;
      float top = -3.0e38f, sum = 0.f;
      for (int64_t t = 0; t < lens[j]; ++t) top = std::max(top, s[t]);
      for (int64_t t = 0; t < lens[j]; ++t) sum += (s[t] = std::exp(s[t] - top));
      std::fill(s + lens[j], s + longest, 0.f);
      total[j] = sum;
    }
    std::fill(acc, acc + g * d, 0.f);
    std::fill(acc_res, acc_res + g * r, 0.f);
    for (int64_t t = 0; t < longest; ++t) {  // P V_base and P R_v, apart
      const T* v = vb.row(t) + kh;
      const T* rv = vr.row(t);
      for (int64_t i = 0; i < d; ++i) row[i] = static_cast<float>(v[i]);
      for (int64_t j = 0; j < g; ++j) {
        const float p = sc[j * longest + t];
        float* aj = acc + j * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) aj[i] += p * row[i];
        for (int64_t c = 0; c < r; ++c) acc_res[j * r + c] += p * static_cast<float>(rv[c]);
      }
    }
    for (int64_t j = 0; j < g; ++j) {  // + (P R_v) s B_v, then the softmax's division
      float* aj = acc + j * d;
      for (int64_t c = 0; c < r; ++c) {
        const float pc = acc_res[j * r + c];
        const float* col = w.bv[c];
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) aj[i] += pc * col[i];
      }
      const int64_t rr = first_row + (first + j) / ratio, qh = h * ratio + (first + j) % ratio;
      T* dst = out + rr * out_row + qh * out_head;
      const float inv = lens[j] > 0 ? 1.f / total[j] : 0.f;
      for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(aj[i] * inv);
    }
  }
}

template <typename T>
using TaskFn = void (*)(const Call&, const T*, int64_t, int64_t, const Paged<T>&, const Paged<T>&, const Paged<T>&,
                        const Paged<T>&, const float*, const float*, const HeadWeights&, int64_t, int64_t,
                        const int32_t*, int64_t, T*, int64_t, int64_t, std::vector<float>&);

template <typename T, int D>
TaskFn<T> task_fn_for_rank(int64_t r) {
  return r == 8 ? attend_task<T, D, 8> : r == 16 ? attend_task<T, D, 16> : attend_task<T, D, 0>;
}

template <typename T>
TaskFn<T> task_fn(int64_t d, int64_t r) {
  return d == 64 ? task_fn_for_rank<T, 64>(r) : d == 128 ? task_fn_for_rank<T, 128>(r) : task_fn_for_rank<T, 0>(r);
}

template <typename T>
void run(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
         const torch::Tensor& k_res, const torch::Tensor& v_res, const torch::Tensor& b_k, const torch::Tensor& b_v,
         const torch::Tensor& lora_scales, const torch::Tensor& rope_cos, const torch::Tensor& rope_sin,
         const torch::Tensor& tables, const torch::Tensor& res_tables, const torch::Tensor& starts,
         const torch::Tensor& row_lens, const torch::Tensor& seq_adapter, const torch::Tensor& seqs, double scale,
         torch::Tensor& out) {
  const Call call{q.size(1), k_cache.size(2), q.size(2), k_res.size(2), q.size(1) / k_cache.size(2),
                  static_cast<float>(scale)};
  const int32_t* sp = starts.data_ptr<int32_t>();
  const int32_t* lp = row_lens.data_ptr<int32_t>();
  const int32_t* ap = seq_adapter.data_ptr<int32_t>();
  const int32_t* wanted = seqs.data_ptr<int32_t>();
  std::vector<Task> tasks;
  for (int64_t i = 0; i < seqs.size(0); ++i) {
    const int64_t s = wanted[i];
    int64_t cost = 0;
    for (int64_t row = sp[s]; row < sp[s + 1]; ++row) cost += lp[row];
    for (int64_t h = 0; h < call.kv_heads; ++h) tasks.push_back({s, h, cost});
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  const float* bkp = b_k.data_ptr<float>();
  const float* bvp = b_v.data_ptr<float>();
  const float* scp = lora_scales.data_ptr<float>();
  const int64_t b_stride = b_k.size(1) * b_k.size(2);
  auto paged = [](const torch::Tensor& cache, const torch::Tensor& tables, int64_t s) {
    return Paged<T>{cache.data_ptr<T>(), tables.data_ptr<int32_t>() + s * tables.size(1), cache.size(1),
                    cache.stride(0), cache.stride(1)};
  };
  const TaskFn<T> fn = task_fn<T>(call.d, call.r);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> scores;
    std::unique_ptr<HeadWeights> weights(new HeadWeights);  // not zeroed: each task fills what it reads
    for (int64_t i = next++; i < static_cast<int64_t>(tasks.size()); i = next++) {
      const Task& task = tasks[i];
      const int64_t s = task.seq, a = ap[s];
      load_head_weights(bkp + a * b_stride, bvp + a * b_stride, scp[a], task.kv_head, call.d, call.r, *weights);
      fn(call, q.data_ptr<T>(), q.stride(0), q.stride(1), paged(k_cache, tables, s), paged(v_cache, tables, s),
         paged(k_res, res_tables, s), paged(v_res, res_tables, s), rope_cos.data_ptr<float>(),
         rope_sin.data_ptr<float>(), *weights, sp[s], sp[s + 1] - sp[s], lp, task.kv_head, out.data_ptr<T>(),
         out.stride(0), out.stride(1), scores);
    }
  });
}

}  // namespace

// q, out: (rows, heads, d) rows grouped by sequence; k_cache, v_cache: (blocks, block_size, kv_heads, d);
// k_res, v_res: (blocks', block_size', r), all with contiguous last dims and q's dtype; b_k, b_v:
// (adapters, kv_heads * d, r) float32 contiguous; lora_scales: (adapters,) float32; rope_cos, rope_sin:
// (positions, d) float32 contiguous; tables / res_tables: (sequences, width) int32 block ids of the two
// pools; starts: (sequences + 1) int32; row_lens: (rows,) int32 keys each row reads; seq_adapter:
// (sequences,) int32; seqs: int32 the sequences to compute (only their rows of out are written).
void residual_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k_res,
                        torch::Tensor v_res, torch::Tensor b_k, torch::Tensor b_v, torch::Tensor lora_scales,
                        torch::Tensor rope_cos, torch::Tensor rope_sin, torch::Tensor tables, torch::Tensor res_tables,
                        torch::Tensor starts, torch::Tensor row_lens, torch::Tensor seq_adapter, torch::Tensor seqs,
                        double scale, torch::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && q.stride(2) == 1 && out.stride(2) == 1,
              "q and out: (rows, heads, d) with a contiguous last dim");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.stride(3) == 1 &&
                  v_cache.stride(3) == 1 && k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0,
              "k_cache and v_cache: (blocks, block_size, kv_heads, d), query heads a multiple of kv_heads");
  TORCH_CHECK(k_res.dim() == 3 && v_res.sizes() == k_res.sizes() && k_res.stride(2) == 1 && v_res.stride(2) == 1,
              "residual pools: (blocks, block_size, r) with a contiguous last dim");
  TORCH_CHECK(q.size(2) <= kMaxD && q.size(2) % 2 == 0 && k_res.size(2) <= kMaxRank, "head size or rank too large");
  const int64_t n = k_cache.size(2) * q.size(2);
  for (const auto* t : {&b_k, &b_v})
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->dim() == 3 && t->size(1) == n &&
                    t->size(2) == k_res.size(2),
                "b_k, b_v: (adapters, kv_heads * d, r) contiguous float32");
  for (const auto* t : {&rope_cos, &rope_sin})
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->size(1) == q.size(2),
                "rope tables: (positions, d) contiguous float32");
  TORCH_CHECK(lora_scales.scalar_type() == torch::kFloat32 && lora_scales.is_contiguous(), "lora_scales: float32");
  for (const auto* t : {&tables, &res_tables, &starts, &row_lens, &seq_adapter, &seqs})
    TORCH_CHECK(t->scalar_type() == torch::kInt32 && t->is_contiguous(), "index tensors: contiguous int32");
  for (const auto* t : {&k_cache, &v_cache, &k_res, &v_res, &out})
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "q, the pools and out share one dtype");
  switch (q.scalar_type()) {
    case torch::kFloat32:
      run<float>(q, k_cache, v_cache, k_res, v_res, b_k, b_v, lora_scales, rope_cos, rope_sin, tables, res_tables,
                 starts, row_lens, seq_adapter, seqs, scale, out);
      break;
    case torch::kBFloat16:
      run<c10::BFloat16>(q, k_cache, v_cache, k_res, v_res, b_k, b_v, lora_scales, rope_cos, rope_sin, tables,
                         res_tables, starts, row_lens, seq_adapter, seqs, scale, out);
      break;
    case torch::kFloat16:
      run<c10::Half>(q, k_cache, v_cache, k_res, v_res, b_k, b_v, lora_scales, rope_cos, rope_sin, tables,
                     res_tables, starts, row_lens, seq_adapter, seqs, scale, out);
      break;
    default: TORCH_CHECK(false, "residual_attention takes float32, bfloat16 or float16");
  }
}
