// bfloat16 projections of a few rows (decode steps) in AVX512-BF16 dot products.
//
// Why: on CPUs with AVX512-BF16 and no AMX, Inductor's C++ GEMM template multiplies bfloat16 by
// widening every weight to float32 and using FMAs: compute-bound at one or two rows, so the
// compiled graph for two rows (an ICaRus pair) took about 13% longer than for one.
// `vdpbf16ps` multiplies two bfloat16 pairs per lane straight from the weight bytes, so the
// weight stream, not the arithmetic, sets the pace: a few rows cost about what one row does.
//
// The weight [N, K] is packed once into VNNI order, [N/16][K/2][16][2]: for 16 outputs, each
// 64-byte vector holds one pair of input dims, as `vdpbf16ps` takes it. A row's matching pair is
// broadcast against it. Four rows by four 16-output blocks accumulate in 16 registers; each
// thread takes a contiguous range of blocks, and every further four rows reuse those four blocks
// while they are in cache.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>

namespace {

constexpr int64_t kLanes = 16;  // outputs per block
constexpr int kRowTile = 4;

#if defined(__AVX512BF16__)
template <int R, int B>
inline void tile(const uint16_t* x, int64_t K, const uint16_t* w, int64_t block0, const float* bias,
                 uint16_t* y, int64_t N) {
  const int64_t pairs = K / 2;
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  const uint32_t* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = reinterpret_cast<const uint32_t*>(x + r * K);
  const __m512i* wb[B];
  for (int b = 0; b < B; ++b) wb[b] = reinterpret_cast<const __m512i*>(w + (block0 + b) * pairs * 2 * kLanes);
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i wv[B];
    for (int b = 0; b < B; ++b) wv[b] = _mm512_loadu_si512(wb[b] + p);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[r][p]));
      for (int b = 0; b < B; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, (__m512bh)wv[b]);
    }
  }
  for (int b = 0; b < B; ++b) {
    const __m512 add = bias ? _mm512_loadu_ps(bias + (block0 + b) * kLanes) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][b], add));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * N + (block0 + b) * kLanes), (__m256i)out);
    }
  }
}

template <int B>
void rows_of(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t block0, const float* bias,
             uint16_t* y, int64_t N) {
  // every row over the same B blocks while they are in cache: each weight byte leaves memory once
  for (int64_t m = 0; m < M; m += kRowTile) {
    const uint16_t* xm = x + m * K;
    uint16_t* ym = y + m * N;
    switch (std::min<int64_t>(kRowTile, M - m)) {
      case 1: tile<1, B>(xm, K, w, block0, bias, ym, N); break;
      case 2: tile<2, B>(xm, K, w, block0, bias, ym, N); break;
      case 3: tile<3, B>(xm, K, w, block0, bias, ym, N); break;
      default: tile<4, B>(xm, K, w, block0, bias, ym, N); break;
    }
  }
}
#endif

}  // namespace

bool linear_vnni_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

torch::Tensor linear_vnni_pack(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16, "a 2-D bfloat16 weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % kLanes == 0 && K % 2 == 0, "outputs a multiple of 16 and an even input size");
  return weight.contiguous().view({N / kLanes, kLanes, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

torch::Tensor linear_vnni(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && packed.scalar_type() == torch::kBFloat16, "bfloat16");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kLanes && packed.size(3) == 2, "a weight from linear_vnni_pack");
  const int64_t K = x.size(-1), N = packed.size(0) * kLanes;
  TORCH_CHECK(packed.size(1) * 2 == K, "input size ", K, " against the weight's ", packed.size(1) * 2);
  auto rows = x.reshape({-1, K}).contiguous();
  const int64_t M = rows.size(0);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = torch::empty(sizes, x.options());
  torch::Tensor bias32;
  if (bias.has_value()) bias32 = bias->to(torch::kFloat32).contiguous();
  const float* b32 = bias.has_value() ? bias32.data_ptr<float>() : nullptr;
  auto xs = reinterpret_cast<const uint16_t*>(rows.data_ptr());
  auto ws = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto ys = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t total = packed.size(0);
  const int64_t per_thread = (total + at::get_num_threads() - 1) / at::get_num_threads();
  at::parallel_for(0, total, per_thread, [&](int64_t first, int64_t last) {
    int64_t b = first;
    for (; b + 4 <= last; b += 4) rows_of<4>(xs, M, K, ws, b, b32, ys, N);
    for (; b + 2 <= last; b += 2) rows_of<2>(xs, M, K, ws, b, b32, ys, N);
    for (; b < last; ++b) rows_of<1>(xs, M, K, ws, b, b32, ys, N);
  });
  return y;
#else
  TORCH_CHECK(false, "linear_vnni needs a CPU with AVX512-BF16 (this build has none)");
#endif
}

// The op the compiled step's graphs call, registered here rather than as a Python custom op: a
// Python op body cost about 6 us a call, some 0.8 ms of a 9 ms decode step's 121 projections.
// Its fake (shape) function is registered from Python (kvshare.kernels.cpu.linear).
TORCH_LIBRARY_FRAGMENT(kvshare, m) {
  m.def("linear_vnni(Tensor x, Tensor packed, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvshare, CPU, m) {
  m.impl("linear_vnni", &linear_vnni);
}
