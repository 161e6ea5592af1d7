// A few rows (decode steps) times a weight in int8 groups of 32 inputs, each group with a float32
// scale: llama.cpp's Q8_0 format (its scales are float16), which it uses for a tied LM head.
//
// Why: with int4 layers, the tied head of a small model is the largest weight a decode step reads
// (SmolLM2-135M: 49,152 x 576, 57 MB in bfloat16 against 68 MB for all 30 layers in int4). In int8
// groups it is 32 MB, at the precision llama.cpp serves the head in. PyTorch's int8 kernel
// (`_weight_int8pack_mm`) takes one scale per output row only, coarser than a group of 32.
//
// The weight [N, K] is packed once as [N/16][K][16] int8 (16 outputs' bytes of one input dim side
// by side) with scales [N/16][K/32][16]. Each 16 bytes widen to 16 floats times their group's 16
// scales, then one FMA per row: the widening is shared by eight rows. Eight rows by two 16-output
// blocks accumulate in registers; each thread takes a contiguous range of blocks, and every further
// eight rows reuse those blocks while they are in cache. Activations stay as given (bfloat16 or float32,
// widened exactly), sums in float32, the output rounded to the input's dtype once.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>

namespace {

constexpr int64_t kQ8Lanes = 16;  // outputs per block
constexpr int64_t kQ8Group = 32;  // inputs per scale
constexpr int kQ8RowTile = 8;

#if defined(__AVX512F__)
template <int R, int B>
inline void q8_tile(const float* x, int64_t K, const int8_t* w, const float* scales, int64_t block0,
                    const float* bias, float* y, int64_t N) {
  const int64_t groups = K / kQ8Group;
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 scale[B];
    for (int b = 0; b < B; ++b) scale[b] = _mm512_loadu_ps(scales + ((block0 + b) * groups + g) * kQ8Lanes);
    for (int64_t k = g * kQ8Group; k < (g + 1) * kQ8Group; ++k) {
      __m512 wv[B];  // 16 outputs' weights of input k, scaled (exact int8, one float32 rounding)
      for (int b = 0; b < B; ++b) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + ((block0 + b) * K + k) * kQ8Lanes));
        wv[b] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), scale[b]);
      }
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(x[r * K + k]);
        for (int b = 0; b < B; ++b) acc[r][b] = _mm512_fmadd_ps(wv[b], xv, acc[r][b]);
      }
    }
  }
  for (int b = 0; b < B; ++b) {
    const __m512 add = bias ? _mm512_loadu_ps(bias + (block0 + b) * kQ8Lanes) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * N + (block0 + b) * kQ8Lanes, _mm512_add_ps(acc[r][b], add));
  }
}

template <int B>
void q8_rows(const float* x, int64_t M, int64_t K, const int8_t* w, const float* scales, int64_t block0,
             const float* bias, float* y, int64_t N) {
  for (int64_t m = 0; m < M; m += kQ8RowTile) {
    const float* xm = x + m * K;
    float* ym = y + m * N;
    switch (std::min<int64_t>(kQ8RowTile, M - m)) {
      case 1: q8_tile<1, B>(xm, K, w, scales, block0, bias, ym, N); break;
      case 2: q8_tile<2, B>(xm, K, w, scales, block0, bias, ym, N); break;
      case 3: q8_tile<3, B>(xm, K, w, scales, block0, bias, ym, N); break;
      case 4: q8_tile<4, B>(xm, K, w, scales, block0, bias, ym, N); break;
      case 5: q8_tile<5, B>(xm, K, w, scales, block0, bias, ym, N); break;
      case 6: q8_tile<6, B>(xm, K, w, scales, block0, bias, ym, N); break;
      case 7: q8_tile<7, B>(xm, K, w, scales, block0, bias, ym, N); break;
      default: q8_tile<8, B>(xm, K, w, scales, block0, bias, ym, N); break;
    }
  }
}
#endif

}  // namespace

bool linear_q8_available() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

torch::Tensor linear_q8(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, c10::optional<torch::Tensor> bias) {
#if defined(__AVX512F__)
  TORCH_CHECK(packed.scalar_type() == torch::kChar && packed.dim() == 3 && packed.size(2) == kQ8Lanes,
              "a weight from quantize_q8: int8 [N/16, K, 16]");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.dim() == 3 && scales.size(0) == packed.size(0)
              && scales.size(2) == kQ8Lanes, "float32 scales [N/16, K/32, 16]");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat, "bfloat16 or float32 rows");
  const int64_t K = x.size(-1), N = packed.size(0) * kQ8Lanes;
  TORCH_CHECK(packed.size(1) == K && K % kQ8Group == 0 && scales.size(1) * kQ8Group == K,
              "input size ", K, " against the weight's ", packed.size(1));
  auto rows = x.reshape({-1, K}).to(torch::kFloat).contiguous();
  auto w = packed.contiguous();
  auto s = scales.contiguous();
  const int64_t M = rows.size(0);
  auto y = torch::empty({M, N}, rows.options());
  torch::Tensor bias32;
  if (bias.has_value()) bias32 = bias->to(torch::kFloat32).contiguous();
  const float* b32 = bias.has_value() ? bias32.data_ptr<float>() : nullptr;
  const float* xs = rows.data_ptr<float>();
  const int8_t* ws = w.data_ptr<int8_t>();
  const float* ss = s.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  const int64_t total = packed.size(0);
  const int64_t per_thread = (total + at::get_num_threads() - 1) / at::get_num_threads();
  at::parallel_for(0, total, per_thread, [&](int64_t first, int64_t last) {
    int64_t b = first;
    for (; b + 2 <= last; b += 2) q8_rows<2>(xs, M, K, ws, ss, b, b32, ys, N);
    for (; b < last; ++b) q8_rows<1>(xs, M, K, ws, ss, b, b32, ys, N);
  });
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.view(sizes).to(x.scalar_type());
#else
  TORCH_CHECK(false, "linear_q8 needs a CPU with AVX512 (this build has none)");
#endif
}

// Defined in C++ as linear_vnni is (a Python op body costs microseconds a call); its fake (shape)
// function is registered from Python (kvshare.kernels.quant).
TORCH_LIBRARY_FRAGMENT(kvshare, m) {
  m.def("linear_q8(Tensor x, Tensor packed, Tensor scales, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvshare, CPU, m) {
  m.impl("linear_q8", &linear_q8);
}
