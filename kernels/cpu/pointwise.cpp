// A decoder layer's pointwise parts, fused: RMSNorm (alone or after the residual add), RoPE of
// queries and keys, SiLU(gate) * up; float32 or bfloat16.
//
// Why: the eager step (prompt chunks) ran them as PyTorch ops, a dozen per layer, each a pass
// over the whole activation with its own allocation and parallel region. Measured on 2 Sapphire
// Rapids cores, SmolLM2-135M bfloat16, a 1k-token prefill: the norms alone took 47-71 ms of
// ~500, RoPE's rotate_half another 14. Here each part is one pass per row.
//
// Numerics follow kvshare.kernels.pointwise.TorchPointwise (transformers' Llama): the norm's
// sums in float, and every result PyTorch would round to the dtype rounded here too (to nearest
// even), so bfloat16 outputs match it but for the order of the norm's sum and SiLU's exp (our own).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

inline float load(float x) { return x; }
inline float load(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// x rounded to T's precision, as a float (what PyTorch's op in T would hold)
template <typename T>
inline float round_to(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof(bits));
    bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  }
}

template <typename T>
inline T store(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    const float rounded = round_to<T>(x);
    uint32_t bits;
    std::memcpy(&bits, &rounded, sizeof(bits));
    c10::BFloat16 out;
    out.x = static_cast<uint16_t>(bits >> 16);
    return out;
  }
}

constexpr int64_t kGrain = 8;  // rows per parallel task

// e^x in float arithmetic the compiler vectorizes (std::exp is a libm call per element, which
// made SiLU half of these kernels' time): x = n ln2 + r with |r| <= ln2/2, e^r by its Taylor
// polynomial to r^7 (relative error below 2e-8), times 2^n built in the exponent bits.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.f), 88.f);  // 2^n stays a normal float
  const int n = static_cast<int>(x * 1.44269504088896341f + (x >= 0.f ? 0.5f : -0.5f));
  const float nf = static_cast<float>(n);
  const float r = (x - nf * 0.693145751953125f) - nf * 1.428606765330187e-06f;  // ln2 in two parts
  float p = 1.f / 5040;
  for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = p * r + c;
  const uint32_t bits = static_cast<uint32_t>(n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// out = weight * round(h / rms(h)) of one row held in float
template <typename T>
inline void norm_row(const float* h, const T* weight, int64_t d, float eps, T* out) {
  float sum = 0.f;
  for (int64_t i = 0; i < d; ++i) sum += h[i] * h[i];
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(d) + eps);
  for (int64_t i = 0; i < d; ++i) out[i] = store<T>(load(weight[i]) * round_to<T>(h[i] * inv));
}

template <typename T>
void rms_norm_impl(const torch::Tensor& x, const torch::Tensor& weight, double eps, torch::Tensor& out) {
  const int64_t heads = x.dim() == 3 ? x.size(1) : 1, d = x.size(-1), rows = x.size(0);
  const int64_t row_stride = x.stride(0), head_stride = x.dim() == 3 ? x.stride(1) : 0;
  const T* src = x.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, rows * heads, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> h(d);
    for (int64_t v = begin; v < end; ++v) {
      const T* row = src + (v / heads) * row_stride + (v % heads) * head_stride;
      for (int64_t i = 0; i < d; ++i) h[i] = load(row[i]);
      norm_row<T>(h.data(), w, d, static_cast<float>(eps), dst + v * d);
    }
  });
}

template <typename T>
void add_rms_norm_impl(const torch::Tensor& h, const torch::Tensor& delta, const torch::Tensor& weight, double eps,
                       torch::Tensor& sum, torch::Tensor& normed) {
  const int64_t rows = h.size(0), d = h.size(1);
  const T* a = h.data_ptr<T>();
  const T* b = delta.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  T* s = sum.data_ptr<T>();
  T* out = normed.data_ptr<T>();
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> row(d);
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t i = 0; i < d; ++i) {
        row[i] = round_to<T>(load(a[r * d + i]) + load(b[r * d + i]));
        s[r * d + i] = store<T>(row[i]);
      }
      norm_row<T>(row.data(), w, d, static_cast<float>(eps), out + r * d);
    }
  });
}

// x * cos + rotate_half(x) * sin of one head, each product rounded as PyTorch's ops round it
template <typename T>
inline void rope_head(const T* x, const T* cos, const T* sin, int64_t d, T* out) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i)
    out[i] = store<T>(round_to<T>(load(x[i]) * load(cos[i])) + round_to<T>(-load(x[i + half]) * load(sin[i])));
  for (int64_t i = half; i < d; ++i)
    out[i] = store<T>(round_to<T>(load(x[i]) * load(cos[i])) + round_to<T>(load(x[i - half]) * load(sin[i])));
}

template <typename T>
void rope_impl(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& cos, const torch::Tensor& sin,
               torch::Tensor& q_out, torch::Tensor& k_out) {
  const int64_t rows = q.size(0), hq = q.size(1), hk = k.size(1), d = q.size(2);
  const T *qs = q.data_ptr<T>(), *ks = k.data_ptr<T>(), *c = cos.data_ptr<T>(), *s = sin.data_ptr<T>();
  T *qo = q_out.data_ptr<T>(), *ko = k_out.data_ptr<T>();
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t h = 0; h < hq; ++h)
        rope_head<T>(qs + r * q.stride(0) + h * q.stride(1), c + r * d, s + r * d, d, qo + (r * hq + h) * d);
      for (int64_t h = 0; h < hk; ++h)
        rope_head<T>(ks + r * k.stride(0) + h * k.stride(1), c + r * d, s + r * d, d, ko + (r * hk + h) * d);
    }
  });
}

template <typename T>
void silu_mul_impl(const torch::Tensor& gate_up, int64_t inter, torch::Tensor& out) {
  const int64_t rows = gate_up.size(0), stride = gate_up.stride(0);
  const T* src = gate_up.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = src + r * stride;
      const T* up = gate + inter;
      for (int64_t i = 0; i < inter; ++i) {
        const float g = load(gate[i]);
        dst[r * inter + i] = store<T>(round_to<T>(g / (1.f + exp_approx(-g))) * load(up[i]));
      }
    }
  });
}

void check_dtype(const torch::Tensor& t, const torch::Tensor& like, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == like.scalar_type(), name, ": CPU tensors of one dtype");
}

#define KVSHARE_FLOAT_OR_BF16(dtype, ...)                                                  \
  do {                                                                                     \
    if ((dtype) == torch::kFloat32) {                                                      \
      using scalar = float;                                                                \
      __VA_ARGS__;                                                                         \
    } else {                                                                               \
      TORCH_CHECK((dtype) == torch::kBFloat16, "pointwise kernels: float32 or bfloat16");   \
      using scalar = c10::BFloat16;                                                        \
      __VA_ARGS__;                                                                         \
    }                                                                                      \
  } while (0)

}  // namespace

torch::Tensor pointwise_rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && x.stride(-1) == 1, "rms_norm: rows (and heads) of contiguous vectors");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(-1), "rms_norm: one weight per dim");
  check_dtype(weight, x, "rms_norm");
  auto out = torch::empty(x.sizes(), x.options());
  KVSHARE_FLOAT_OR_BF16(x.scalar_type(), rms_norm_impl<scalar>(x, weight, eps, out));
  return out;
}

std::tuple<torch::Tensor, torch::Tensor> pointwise_add_rms_norm(torch::Tensor h, torch::Tensor delta,
                                                                torch::Tensor weight, double eps) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && delta.is_contiguous() && h.sizes() == delta.sizes(),
              "add_rms_norm: two contiguous (rows, dim) tensors");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == h.size(1), "add_rms_norm: one weight per dim");
  check_dtype(delta, h, "add_rms_norm");
  check_dtype(weight, h, "add_rms_norm");
  auto sum = torch::empty_like(h), normed = torch::empty_like(h);
  KVSHARE_FLOAT_OR_BF16(h.scalar_type(), add_rms_norm_impl<scalar>(h, delta, weight, eps, sum, normed));
  return {sum, normed};
}

std::tuple<torch::Tensor, torch::Tensor> pointwise_rope(torch::Tensor q, torch::Tensor k, torch::Tensor cos,
                                                        torch::Tensor sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 && q.size(2) == k.size(2) &&
                  q.size(0) == k.size(0) && q.size(2) % 2 == 0,
              "rope: queries and keys (rows, heads, even head_dim), head vectors contiguous");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == q.size(0) * q.size(2) &&
                  sin.numel() == cos.numel(),
              "rope: contiguous cos and sin, one head_dim vector per row");
  for (const auto* t : {&k, &cos, &sin}) check_dtype(*t, q, "rope");
  auto q_out = torch::empty(q.sizes(), q.options()), k_out = torch::empty(k.sizes(), k.options());
  KVSHARE_FLOAT_OR_BF16(q.scalar_type(), rope_impl<scalar>(q, k, cos, sin, q_out, k_out));
  return {q_out, k_out};
}

torch::Tensor pointwise_silu_mul(torch::Tensor gate_up, int64_t inter) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) == 2 * inter,
              "silu_mul: rows of gate then up, contiguous");
  TORCH_CHECK(gate_up.device().is_cpu(), "silu_mul: CPU tensors");
  auto out = torch::empty({gate_up.size(0), inter}, gate_up.options());
  KVSHARE_FLOAT_OR_BF16(gate_up.scalar_type(), silu_mul_impl<scalar>(gate_up, inter, out));
  return out;
}
