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
//
// `linear_vnni_lora` adds each row's LoRA delta, scale * (x A^T) B^T with the row's own slot of
// the stacks, in the same op: the shrink x A^T (rank-wide, a few dot products per row) runs
// first; each thread expands the deltas of its own output blocks (B^T read in order), and its
// tiles add them before their one rounding. Rows whose scale is 0 (no adapter, an ICaRus pair's
// base row, pad rows) skip both. In the compiled step's graph the same delta took Inductor two
// reductions per projection, each a parallel region with its barriers: 0.65 ms of a 10.7 ms
// ICaRus pair step (results/engine-cpu-bf16/session23).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;  // outputs per block
constexpr int kRowTile = 4;

// The LoRA delta of the rows being multiplied: per part (a projection of a fused weight) its
// output columns and B^T stacks, per row its slot and its x A^T, scaled.
constexpr int kMaxParts = 4;
struct LoraEpilogue {
  int64_t parts = 0, max_rank = 0;
  int64_t offset[kMaxParts], width[kMaxParts], rank[kMaxParts];  // first output column, columns, rank
  const uint16_t* b[kMaxParts];  // B^T [slots][rank][width]
  const int64_t* slot;           // per row
  const float* scale;            // per row; 0: no delta
  std::vector<float> t;          // [row][part][max_rank]: scale * x A^T
  std::vector<float> delta;      // [row][N]: the deltas, filled per thread for its own blocks
};

#if defined(__AVX512BF16__)
inline __m512 widen(const uint16_t* p) {  // 16 bfloat16 to float32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(p))), 16));
}

// sum of x[k] * a[k] over k < K, the pairs in dot products
inline float dot(const uint16_t* x, const uint16_t* a, int64_t K) {
  __m512 acc = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(x + k), (__m512bh)_mm512_loadu_si512(a + k));
  float sum = _mm512_reduce_add_ps(acc);
  for (; k < K; ++k) {
    uint32_t xb = uint32_t(x[k]) << 16, ab = uint32_t(a[k]) << 16;
    float xf, af;
    std::memcpy(&xf, &xb, 4);
    std::memcpy(&af, &ab, 4);
    sum += xf * af;
  }
  return sum;
}

// The deltas of blocks [first, last) for every row with a scale: for each rank, a row of B^T
// (read in order) times that rank's x A^T. Each thread fills its own blocks before multiplying
// them, so the tile's epilogue only adds a vector.
void fill_deltas(LoraEpilogue& lora, int64_t M, int64_t N, int64_t first, int64_t last) {
  for (int64_t m = 0; m < M; ++m) {
    if (lora.scale[m] == 0.f) continue;
    float* out = lora.delta.data() + m * N;
    for (int64_t block = first; block < last; ++block) _mm512_storeu_ps(out + block * kLanes, _mm512_setzero_ps());
    for (int64_t p = 0; p < lora.parts; ++p) {
      const int64_t begin = std::max(first * kLanes, lora.offset[p]);
      const int64_t end = std::min(last * kLanes, lora.offset[p] + lora.width[p]);
      if (begin >= end) continue;
      const int64_t rank = lora.rank[p], width = lora.width[p];
      const float* t = lora.t.data() + (m * lora.parts + p) * lora.max_rank;
      const uint16_t* bt = lora.b[p] + lora.slot[m] * rank * width - lora.offset[p];
      for (int64_t c = begin; c < end; c += kLanes) {
        __m512 acc = _mm512_loadu_ps(out + c);
        for (int64_t j = 0; j < rank; ++j) acc = _mm512_fmadd_ps(_mm512_set1_ps(t[j]), widen(bt + j * width + c), acc);
        _mm512_storeu_ps(out + c, acc);
      }
    }
  }
}

template <int R, int B>
inline void tile(const uint16_t* x, int64_t K, const uint16_t* w, int64_t block0, const float* bias,
                 uint16_t* y, int64_t N, int64_t m0, const LoraEpilogue* lora) {
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
      __m512 sum = _mm512_add_ps(acc[r][b], add);
      if (lora && lora->scale[m0 + r] != 0.f)
        sum = _mm512_add_ps(sum, _mm512_loadu_ps(lora->delta.data() + (m0 + r) * N + (block0 + b) * kLanes));
      const __m256bh out = _mm512_cvtneps_pbh(sum);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * N + (block0 + b) * kLanes), (__m256i)out);
    }
  }
}

template <int B>
void rows_of(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t block0, const float* bias,
             uint16_t* y, int64_t N, const LoraEpilogue* lora) {
  // every row over the same B blocks while they are in cache: each weight byte leaves memory once
  for (int64_t m = 0; m < M; m += kRowTile) {
    const uint16_t* xm = x + m * K;
    uint16_t* ym = y + m * N;
    switch (std::min<int64_t>(kRowTile, M - m)) {
      case 1: tile<1, B>(xm, K, w, block0, bias, ym, N, m, lora); break;
      case 2: tile<2, B>(xm, K, w, block0, bias, ym, N, m, lora); break;
      case 3: tile<3, B>(xm, K, w, block0, bias, ym, N, m, lora); break;
      default: tile<4, B>(xm, K, w, block0, bias, ym, N, m, lora); break;
    }
  }
}

// y = x W^T + bias (+ the LoRA epilogue's deltas), rounded to bfloat16 once; `rows` is x as
// [M, K], contiguous
torch::Tensor multiply(const torch::Tensor& x, const torch::Tensor& rows, const torch::Tensor& packed,
                       const c10::optional<torch::Tensor>& bias, LoraEpilogue* lora) {
  const int64_t K = x.size(-1), N = packed.size(0) * kLanes;
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
    if (lora) fill_deltas(*lora, M, N, first, last);
    int64_t b = first;
    for (; b + 4 <= last; b += 4) rows_of<4>(xs, M, K, ws, b, b32, ys, N, lora);
    for (; b + 2 <= last; b += 2) rows_of<2>(xs, M, K, ws, b, b32, ys, N, lora);
    for (; b < last; ++b) rows_of<1>(xs, M, K, ws, b, b32, ys, N, lora);
  });
  return y;
}
#endif

void check_packed(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && packed.scalar_type() == torch::kBFloat16, "bfloat16");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kLanes && packed.size(3) == 2, "a weight from linear_vnni_pack");
  TORCH_CHECK(packed.is_contiguous(), "a weight from linear_vnni_pack (contiguous: it is read as dense blocks)");
  TORCH_CHECK(packed.size(1) * 2 == x.size(-1), "input size ", x.size(-1), " against the weight's ", packed.size(1) * 2);
  TORCH_CHECK(!bias || bias->numel() == packed.size(0) * kLanes, "a bias of ", packed.size(0) * kLanes,
              " values (one per output column)");
}

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
  check_packed(x, packed, bias);
  return multiply(x, x.reshape({-1, x.size(-1)}).contiguous(), packed, bias, nullptr);
#else
  TORCH_CHECK(false, "linear_vnni needs a CPU with AVX512-BF16 (this build has none)");
#endif
}

// linear_vnni plus each row's LoRA delta: part p of the output (columns offsets[p] ..
// offsets[p] + b_t[p].size(2), multiples of 16) gets scale[row] * (x A_p[slot]^T) B_p[slot]^T,
// where a[p] is [slots, rank, K], b_t[p] [slots, rank, width] and slot = index[row].
torch::Tensor linear_vnni_lora(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                               std::vector<torch::Tensor> a, std::vector<torch::Tensor> b_t,
                               std::vector<int64_t> offsets, torch::Tensor index, torch::Tensor scale) {
#if defined(__AVX512BF16__)
  check_packed(x, packed, bias);
  const int64_t K = x.size(-1), N = packed.size(0) * kLanes, parts = static_cast<int64_t>(a.size());
  TORCH_CHECK(static_cast<int64_t>(b_t.size()) == parts && static_cast<int64_t>(offsets.size()) == parts,
              "one A, one B^T and one offset per part");
  auto rows = x.reshape({-1, K}).contiguous();
  const int64_t M = rows.size(0);
  TORCH_CHECK(index.numel() == M && scale.numel() == M, "a slot and a scale per row");
  TORCH_CHECK(parts <= kMaxParts, "at most ", kMaxParts, " parts");
  auto slots = index.scalar_type() == torch::kInt64 ? index.contiguous() : index.to(torch::kInt64).contiguous();
  auto scales = scale.scalar_type() == torch::kFloat32 ? scale.contiguous() : scale.to(torch::kFloat32).contiguous();
  LoraEpilogue lora;
  lora.parts = parts;
  lora.slot = slots.data_ptr<int64_t>();
  lora.scale = scales.data_ptr<float>();
  for (int64_t p = 0; p < parts; ++p) {
    a[p] = a[p].contiguous();
    b_t[p] = b_t[p].contiguous();
    TORCH_CHECK(a[p].scalar_type() == torch::kBFloat16 && b_t[p].scalar_type() == torch::kBFloat16, "bfloat16 stacks");
    TORCH_CHECK(a[p].dim() == 3 && b_t[p].dim() == 3 && a[p].size(2) == K && a[p].size(0) == b_t[p].size(0)
                && a[p].size(1) == b_t[p].size(1), "A [slots, rank, in] and B^T [slots, rank, out] of one stack");
    const int64_t width = b_t[p].size(2), offset = offsets[p];
    TORCH_CHECK(offset % kLanes == 0 && width % kLanes == 0 && offset >= 0 && offset + width <= N,
                "a part's columns: blocks of 16 inside the output");
    for (int64_t q = 0; q < p; ++q)
      TORCH_CHECK(offset + width <= lora.offset[q] || offset >= lora.offset[q] + lora.width[q], "parts overlap");
    lora.offset[p] = offset;
    lora.width[p] = width;
    lora.rank[p] = a[p].size(1);
    lora.b[p] = reinterpret_cast<const uint16_t*>(b_t[p].data_ptr());
    lora.max_rank = std::max(lora.max_rank, a[p].size(1));
  }
  bool any = false;
  auto xs = reinterpret_cast<const uint16_t*>(rows.data_ptr());
  for (int64_t m = 0; m < M; ++m) {
    if (lora.scale[m] == 0.f) continue;
    if (!any) {
      lora.t.assign(M * parts * lora.max_rank, 0.f);
      lora.delta.resize(M * N);
    }
    any = true;
    for (int64_t p = 0; p < parts; ++p) {
      const int64_t slot = lora.slot[m], rank = lora.rank[p];
      TORCH_CHECK(slot >= 0 && slot < a[p].size(0), "slot ", slot, " outside the stacks");
      const uint16_t* ap = reinterpret_cast<const uint16_t*>(a[p].data_ptr()) + slot * rank * K;
      float* t = lora.t.data() + (m * parts + p) * lora.max_rank;
      for (int64_t j = 0; j < rank; ++j) t[j] = lora.scale[m] * dot(xs + m * K, ap + j * K, K);
    }
  }
  return multiply(x, rows, packed, bias, any ? &lora : nullptr);
#else
  TORCH_CHECK(false, "linear_vnni_lora needs a CPU with AVX512-BF16 (this build has none)");
#endif
}

// The ops the compiled step's graphs call, registered here rather than as Python custom ops: a
// Python op body cost about 6 us a call, some 0.8 ms of a 9 ms decode step's 121 projections.
// Their fake (shape) functions are registered from Python (kvshare.kernels.cpu.linear).
TORCH_LIBRARY_FRAGMENT(kvshare, m) {
  m.def("linear_vnni(Tensor x, Tensor packed, Tensor? bias=None) -> Tensor");
  m.def("linear_vnni_lora(Tensor x, Tensor packed, Tensor? bias, Tensor[] a, Tensor[] b_t, int[] offsets, "
        "Tensor index, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvshare, CPU, m) {
  m.impl("linear_vnni", &linear_vnni);
  m.impl("linear_vnni_lora", &linear_vnni_lora);
}
