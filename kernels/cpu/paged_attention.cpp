// Paged attention for a few query rows per sequence (decode rows, ICaRus pairs, short
// chunks), reading K and V where they lie in the paged cache.
//
// Why our own: on CPU, PyTorch's SDPA needs each sequence's keys contiguous, so a decode
// step over long contexts first gathers every key and value (a copy as large as the KV it
// reads) and then reads the copy again. For a few query rows per sequence the work is
// bound by reading K/V once; this kernel does only that. Each (sequence, KV head) task
// keeps its query vectors (every row of the sequence times the query heads sharing that KV
// head: an ICaRus pair is one group of 2x the heads) in float (the AMX and AVX512-BF16 paths
// below: in bfloat16, as they are), walks the sequence's blocks once for the scores and once for the
// weighted values, and accumulates in float.
// Rows attend to keys 0..row_len-1; a row_len of 0 (a pad row) gives zeros.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define KVSHARE_BF16_CHUNKS 1  // bfloat16 64-dim heads, prompt chunks too: on AMX tiles, else AVX512-BF16 dot products
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define KVSHARE_AMX 1
#endif
#endif

namespace {

constexpr int kGroup = 8;  // query vectors per pass over the keys
// A sequence with more rows in a step is a prompt chunk (kvshare.kernels.cpu.FEW_ROWS): on AMX
// its groups fill a whole tile (16 vectors) and its weighted values are tile products too
constexpr int64_t kChunkRows = 16;
constexpr int kChunkGroup = 16;

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// The next block lies anywhere in the pool: ask for its rows while this block is worked on
template <typename T>
inline void prefetch_block(const T* block, int64_t rows, int64_t row_stride, int64_t d) {
  for (int64_t o = 0; o < rows; ++o)
    for (int64_t i = 0; i < d; i += 64 / static_cast<int64_t>(sizeof(T)))
      __builtin_prefetch(block + o * row_stride + i);
}

template <typename T>
inline void load_row(const T* src, float* dst, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) dst[i] = to_float(src[i]);
}

struct Cache {
  const char* base;  // bytes
  int64_t block, token, head;  // strides in elements
};

// One KV head's rows 0..longest-1 (keys or values) block by block, the next block prefetched:
// fn(first row of the block in that head, its first token, its row count)
template <typename T, typename Fn>
__attribute__((always_inline)) inline void for_each_block(const T* base, const Cache& c, const int32_t* table,
                                                          int64_t block_size, int64_t longest, int64_t d, Fn&& fn) {
  for (int64_t t0 = 0; t0 < longest; t0 += block_size) {
    if (t0 + block_size < longest)
      prefetch_block(base + table[t0 / block_size + 1] * c.block, std::min(block_size, longest - t0 - block_size),
                     c.token, d);
    fn(base + table[t0 / block_size] * c.block, t0, std::min(block_size, longest - t0));
  }
}

// Each of one KV head's rows 0..longest-1 in float in ``row``, handed to fn(t)
template <typename T, typename Fn>
__attribute__((always_inline)) inline void for_each_row(const T* base, const Cache& c, const int32_t* table,
                                                        int64_t block_size, int64_t longest, int64_t d, float* row,
                                                        Fn&& fn) {
  for_each_block(base, c, table, block_size, longest, d, [&](const T* block, int64_t t0, int64_t in_block) {
    for (int64_t o = 0; o < in_block; ++o) {
      load_row(block + o * c.token, row, d);
      fn(t0 + o);
    }
  });
}

// Softmax of each of g score rows over the row's own keys (the rest weigh 0); the sums in total
inline void softmax_rows(float* sc, const int64_t* lens, int64_t longest, int64_t g, float* total) {
  for (int64_t j = 0; j < g; ++j) {
    float* s = sc + j * longest;
    const int64_t n = lens[j];
    float top = -3.0e38f;
    for (int64_t t = 0; t < n; ++t) top = std::max(top, s[t]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
      s[t] = std::exp(s[t] - top);
      sum += s[t];
    }
    for (int64_t t = n; t < longest; ++t) s[t] = 0.f;
    total[j] = sum;
  }
}

// One group of G query vectors (rows x heads sharing one KV head) over its keys. D and G are
// compile-time where known (the accumulators then live in registers), else 0 (runtime d, g).
template <typename T, int D, int G>
void attend_group(const float* qf, const int64_t* lens, int64_t longest, int64_t runtime_g, int64_t runtime_d,
                  const T* kbase, const T* vbase, const Cache& kc, const Cache& vc, const int32_t* table,
                  int64_t block_size, float* sc, float* total, float* acc_out) {
  const int64_t d = D ? D : runtime_d, g = G ? G : runtime_g;
  alignas(64) float row[D ? D : 1024];
  // scores: one read of each key row
  for_each_row(kbase, kc, table, block_size, longest, d, row, [&](int64_t t) {
    for (int64_t j = 0; j < g; ++j) {
      const float* qj = qf + j * d;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < d; ++i) dot += qj[i] * row[i];
      sc[j * longest + t] = dot;
    }
  });
  softmax_rows(sc, lens, longest, g, total);
  // weighted values: one read of each value row
  alignas(64) float acc[(G ? G : kGroup) * (D ? D : 1024)];
  std::fill(acc, acc + g * d, 0.f);
  for_each_row(vbase, vc, table, block_size, longest, d, row, [&](int64_t t) {
    for (int64_t j = 0; j < g; ++j) {
      const float p = sc[j * longest + t];
      float* aj = acc + j * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) aj[i] += p * row[i];
    }
  });
  std::copy(acc, acc + g * d, acc_out);
}

template <typename T, int D>
using GroupFn = void (*)(const float*, const int64_t*, int64_t, int64_t, int64_t, const T*, const T*, const Cache&,
                         const Cache&, const int32_t*, int64_t, float*, float*, float*);

template <typename T, int D>
GroupFn<T, D> group_fn(int64_t g) {
  switch (g) {
    case 1: return attend_group<T, D, 1>;
    case 2: return attend_group<T, D, 2>;
    case 3: return attend_group<T, D, 3>;
    case 4: return attend_group<T, D, 4>;
    case 5: return attend_group<T, D, 5>;
    case 6: return attend_group<T, D, 6>;
    case 7: return attend_group<T, D, 7>;
    default: return attend_group<T, D, 8>;
  }
}

#ifdef KVSHARE_BF16_CHUNKS
// The 16 x 16 scores of 16 keys (rows of out) by 16 vectors (columns), times ``by``, into
// sc[j * longest + t0 + key] for the first n keys of each vector j < G
template <int G>
inline void store_score_columns(const float (&out)[16][16], __m512 by, float* sc, int64_t longest, int64_t t0,
                                int64_t n) {
  const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  const __mmask16 mask = n < 16 ? static_cast<__mmask16>((1u << n) - 1) : static_cast<__mmask16>(0xffff);
#pragma GCC unroll 8
  for (int j = 0; j < G; ++j)  // column j of out: vector j's scores
    _mm512_mask_storeu_ps(sc + j * longest + t0, mask, _mm512_mul_ps(_mm512_i32gather_ps(column, &out[0][j], 4), by));
}

// Weighted values of G vectors' weights sc (G x longest) in float FMAs, into acc_out (G x 64)
template <int G>
void value_pass(const float* sc, int64_t longest, const c10::BFloat16* vbase, const Cache& vc, const int32_t* table,
                int64_t block_size, float* acc_out) {
  __m512 acc[G][4];
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < 4; ++c) acc[j][c] = _mm512_setzero_ps();
  for_each_block(vbase, vc, table, block_size, longest, 64, [&](const c10::BFloat16* block, int64_t t0, int64_t in_block) {
    for (int64_t o = 0; o < in_block; ++o) {
      const c10::BFloat16* v = block + o * vc.token;
      __m512 row[4];
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c)  // bfloat16 to float: the 16 bits on top
        row[c] = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 16 * c))), 16));
#pragma GCC unroll 8
      for (int j = 0; j < G; ++j) {
        const __m512 p = _mm512_set1_ps(sc[j * longest + t0 + o]);
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) acc[j][c] = _mm512_fmadd_ps(p, row[c], acc[j][c]);
      }
    }
  });
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc_out + j * 64 + 16 * c, acc[j][c]);
}

// Hands a score pass's tile(keys, n <= 16, first token) one KV head's keys 0..longest-1, 16 at a time
inline auto key_tiles(const c10::BFloat16* kbase, const Cache& kc, const int32_t* table, int64_t block_size,
                      int64_t longest) {
  return [=, &kc](auto&& tile) {
    for_each_block(kbase, kc, table, block_size, longest, 64, [&](const c10::BFloat16* block, int64_t t0, int64_t in_block) {
      for (int64_t o = 0; o < in_block; o += 16) tile(block + o * kc.token, std::min<int64_t>(16, in_block - o), t0 + o);
    });
  };
}

// Scores (times scale) of G <= 16 query vectors, q as raw bfloat16 (G x 64),
// over the keys that walk(tile) hands out, as score_pass_amx gives them, in AVX512-BF16 dot
// products: for CPUs with bfloat16 instructions and no AMX (AMD Zen 4 and later, Intel Cooper
// Lake), where SDPA's CPU flash attention runs bfloat16 no faster than float32. Per dim pair
// the 16 vectors' pairs fill one register and each key's pair is broadcast against it; the 16
// keys' accumulators stay in registers. Exact bfloat16 products, float sums.
template <int G, typename Walk>
void score_pass_dpbf16(const c10::BFloat16* q, float scale, int64_t token_stride, float* sc, int64_t longest,
                       Walk&& walk) {
  alignas(64) uint32_t b[32][16] = {};  // [dim pair][vector]; vectors past G are zero
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(q);
  for (int j = 0; j < G; ++j)
    for (int pair = 0; pair < 32; ++pair) b[pair][j] = pairs[j * 32 + pair];
  alignas(64) float out[16][16];
  alignas(64) c10::BFloat16 padded[16 * 64];
  const __m512 by = _mm512_set1_ps(scale);
  walk([&](const c10::BFloat16* keys, int64_t n, int64_t t0) {
    int64_t stride = token_stride;
    if (n < 16) {  // keys past the block's end may lie past the pool's
      std::memset(padded, 0, sizeof(padded));
      for (int64_t t = 0; t < n; ++t) std::memcpy(padded + t * 64, keys + t * stride, 64 * sizeof(c10::BFloat16));
      keys = padded;
      stride = 64;
    }
    __m512 acc[16];
#pragma GCC unroll 16
    for (int k = 0; k < 16; ++k) acc[k] = _mm512_setzero_ps();
    for (int pair = 0; pair < 32; ++pair) {
      const __m512bh qp = (__m512bh)_mm512_load_si512(b[pair]);
#pragma GCC unroll 16
      for (int k = 0; k < 16; ++k) {
        const int32_t kp = reinterpret_cast<const int32_t*>(keys + k * stride)[pair];
        acc[k] = _mm512_dpbf16_ps(acc[k], qp, (__m512bh)_mm512_set1_epi32(kp));
      }
    }
#pragma GCC unroll 16
    for (int k = 0; k < 16; ++k) _mm512_store_ps(out[k], acc[k]);  // row k: key k against every vector
    store_score_columns<G>(out, by, sc, longest, t0, n);
  });
}
#endif

#ifdef KVSHARE_AMX
// Bfloat16 caches with 64-dim heads (SmolLM2's and many small models') on CPUs with AMX,
// where the kernel lets this process use it. Why a second path: the generic score pass takes
// one horizontal sum per key and query vector, so its work grows with the group (an ICaRus
// pair of 3 query heads per KV head has 6 vectors): with the keys in L2, 30 layers of 8 pairs
// took 12.9 ms against 7.2 ms for 8 single rows, where reading them from memory takes about
// 16 ms. On AMX one tile product per 16 keys and 32 dims gives every vector's dot products at once
// (exact bfloat16 products, float sums), so the score pass costs the same for a pair as for
// one row. The weighted values stay float FMAs with the accumulators in registers (an AMX
// value pass, with the weights split into two bfloat16 parts to keep float accuracy, measured
// no faster: it needs the values re-laid out pairwise by key).

std::atomic<bool> amx_wanted{true};  // paged_attention_set_amx: off runs the generic path (benchmarks, tests)

bool amx_allowed() {
  static const bool permitted = [] {
    constexpr int kReqXcompPerm = 0x1023, kXtiledata = 18;  // arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return permitted && amx_wanted.load(std::memory_order_relaxed);
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Scores (times scale) of G query vectors, q as raw bfloat16 (G x 64), over the keys that
// walk(tile) hands out (tile(first key row, rows <= 16, first token)), into sc[j * longest + t].
// Tiles: 0 scores (16 keys x 16 vectors, float), 1-2 the keys' halves (16 keys x 32 dims),
// 3-4 the query vectors' halves (16 dim pairs x 16 vectors; vectors past G are zero).
template <int G, typename Walk>
void score_pass_amx(const c10::BFloat16* q, float scale, int64_t token_stride, float* sc, int64_t longest,
                    Walk&& walk) {
  TileConfig config;
  for (int t = 0; t < 5; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  _tile_loadconfig(&config);
  alignas(64) uint32_t b[2][16][16] = {};  // [half][dim pair][vector]
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(q);
  for (int j = 0; j < G; ++j)
    for (int pair = 0; pair < 32; ++pair) b[pair / 16][pair % 16][j] = pairs[j * 32 + pair];
  _tile_loadd(3, b[0], 64);
  _tile_loadd(4, b[1], 64);
  alignas(64) float out[16][16];
  alignas(64) c10::BFloat16 padded[16 * 64];
  const __m512 by = _mm512_set1_ps(scale);
  walk([&](const c10::BFloat16* keys, int64_t n, int64_t t0) {
    int64_t stride = token_stride;
    if (n < 16) {  // a tile's rows past its block's end may lie past the pool's
      std::memset(padded, 0, sizeof(padded));
      for (int64_t t = 0; t < n; ++t) std::memcpy(padded + t * 64, keys + t * stride, 64 * sizeof(c10::BFloat16));
      keys = padded;
      stride = 64;
    }
    _tile_zero(0);
    _tile_loadd(1, keys, stride * sizeof(c10::BFloat16));
    _tile_loadd(2, keys + 32, stride * sizeof(c10::BFloat16));
    _tile_dpbf16ps(0, 1, 3);
    _tile_dpbf16ps(0, 2, 4);
    _tile_stored(0, out, 64);
    store_score_columns<G>(out, by, sc, longest, t0, n);
  });
  _tile_release();
}

#endif  // KVSHARE_AMX

#ifdef KVSHARE_BF16_CHUNKS
// paged_attention_set_dpbf16: off runs the generic path where AMX is not used (few rows in float,
// chunks by SDPA), for benchmarks and tests
std::atomic<bool> dpbf16_wanted{true};

// attend_group for bfloat16 and 64 dims: q holds G raw bfloat16 query vectors, scored on AMX
// tiles (``OnTiles``, AMX builds) or in AVX512-BF16 dot products
template <int G, bool OnTiles>
void attend_group_bf16(const c10::BFloat16* q, const int64_t* lens, int64_t longest, float scale,
                       const c10::BFloat16* kbase, const c10::BFloat16* vbase, const Cache& kc, const Cache& vc,
                       const int32_t* table, int64_t block_size, float* sc, float* total, float* acc_out) {
  const auto walk = key_tiles(kbase, kc, table, block_size, longest);
#ifdef KVSHARE_AMX
  if constexpr (OnTiles)
    score_pass_amx<G>(q, scale, kc.token, sc, longest, walk);
  else
#endif
    score_pass_dpbf16<G>(q, scale, kc.token, sc, longest, walk);
  softmax_rows(sc, lens, longest, G, total);
  value_pass<G>(sc, longest, vbase, vc, table, block_size, acc_out);
}

using Bf16GroupFn = void (*)(const c10::BFloat16*, const int64_t*, int64_t, float, const c10::BFloat16*,
                             const c10::BFloat16*, const Cache&, const Cache&, const int32_t*, int64_t, float*, float*,
                             float*);

template <bool OnTiles>
inline Bf16GroupFn bf16_group_fn(int64_t g) {
  switch (g) {
    case 1: return attend_group_bf16<1, OnTiles>;
    case 2: return attend_group_bf16<2, OnTiles>;
    case 3: return attend_group_bf16<3, OnTiles>;
    case 4: return attend_group_bf16<4, OnTiles>;
    case 5: return attend_group_bf16<5, OnTiles>;
    case 6: return attend_group_bf16<6, OnTiles>;
    case 7: return attend_group_bf16<7, OnTiles>;
    default: return attend_group_bf16<8, OnTiles>;
  }
}


// e^x for x <= 0 (scores minus their maximum), 16 at a time: x = n ln2 + r with |r| <= ln2/2,
// e^r by its Taylor polynomial to r^7 (relative error below 2e-8), times 2^n. Why our own: the
// compiler calls libm's scalar expf per score, which took half of a chunk's time.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));  // e^-104 is below float's least: 0 after scaling
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2 in two parts: exact n*hi
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// Softmax weights of one vector's n raw scores (q . k, scaled here), in bfloat16 into w; returns
// their float sum (the output is divided by it, as the decode path does)
inline float softmax_to_weights(const float* s, int64_t n, float scale, c10::BFloat16* w) {
  const auto mask_of = [&](int64_t t) {
    return n - t >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n - t)) - 1);
  };
  __m512 top = _mm512_set1_ps(-3.0e38f);
  for (int64_t t = 0; t < n; t += 16) top = _mm512_mask_max_ps(top, mask_of(t), _mm512_maskz_loadu_ps(mask_of(t), s + t), top);
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(top)), by = _mm512_set1_ps(scale);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 k = mask_of(t);
    const __m512 e = _mm512_maskz_mov_ps(k, exp512(_mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), m), by)));
    sum = _mm512_add_ps(sum, e);
    _mm256_mask_storeu_epi16(w + t, k, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
  }
  return _mm512_reduce_add_ps(sum);
}

// A prompt chunk's keys transposed in dim pairs, as tile products take them on the right: per
// 16 keys, per half of the dims, 16 rows (dim pairs) of 16 keys' pairs (32-bit each); zeros
// past ``longest``. Built once per task and read by each of its groups, so that every group's
// scores come out with a row per query vector, stored as they are. Gathering each vector's
// column out of a keys-by-vectors product per group made a 4k-token bf16 prefill's attention
// take 1.55-1.60 s against 1.21-1.39 s this way (2 AMX cores, SmolLM2, A/B of the two builds).
void keys_in_pairs(const c10::BFloat16* kbase, const Cache& kc, const int32_t* table, int64_t block_size,
                   int64_t longest, std::vector<uint32_t>& keys_t) {
  const int64_t padded = (longest + 15) / 16 * 16;
  keys_t.assign(padded * 32, 0u);
  for (int64_t t = 0; t < longest; ++t) {
    const auto* key = reinterpret_cast<const uint32_t*>(kbase + table[t / block_size] * kc.block +
                                                        (t % block_size) * kc.token);
    uint32_t* dst = keys_t.data() + t / 16 * 512 + t % 16;
    for (int64_t pair = 0; pair < 32; ++pair) dst[(pair / 16) * 256 + (pair % 16) * 16] = key[pair];
  }
}

// Raw scores (q . k) of 16 vectors (raw bfloat16, 16 x 64) against keys_in_pairs' keys, into
// sc (a row of ``stride`` floats per vector, up to the last whole 16 keys), in AVX512-BF16 dot
// products: per dim pair, 16 keys' pairs fill one register and each vector's pair is broadcast.
void chunk_scores_dpbf16(const c10::BFloat16* raw, const std::vector<uint32_t>& keys_t, int64_t longest, float* sc,
                         int64_t stride) {
  const auto* q = reinterpret_cast<const int32_t*>(raw);
  for (int64_t first = 0; first < longest; first += 16) {
    const uint32_t* block = keys_t.data() + first / 16 * 512;
    __m512 acc[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
    for (int pair = 0; pair < 32; ++pair) {
      const __m512bh keys = (__m512bh)_mm512_loadu_si512(block + (pair / 16) * 256 + (pair % 16) * 16);
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], keys, (__m512bh)_mm512_set1_epi32(q[j * 32 + pair]));
    }
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) _mm512_storeu_ps(sc + j * stride + first, acc[j]);
  }
}

// A prompt chunk's values in key pairs, as tile products take them: row i holds keys 2i and
// 2i+1 interleaved per dim (128 bfloat16), rows up to a whole tile of 32 keys, zeros past
// ``longest`` (their weights are zero, and zeros keep them from adding NaN).
void values_in_pairs(const c10::BFloat16* vbase, const Cache& vc, const int32_t* table, int64_t block_size,
                     int64_t longest, std::vector<c10::BFloat16>& pairs) {
  const int64_t padded = (longest + 31) / 32 * 32;
  pairs.assign(padded / 2 * 128, c10::BFloat16());
  const __m512i even = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                        37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i odd = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55, 23, 54,
                                       22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
  const auto row = [&](int64_t t) { return vbase + table[t / block_size] * vc.block + (t % block_size) * vc.token; };
  for (int64_t t = 0; t < longest; t += 2) {
    const __m512i zero = _mm512_setzero_si512();
    c10::BFloat16* dst = pairs.data() + t / 2 * 128;
    for (int64_t half = 0; half < 2; ++half) {  // dims 0-31, then 32-63
      const __m512i a = _mm512_loadu_si512(row(t) + 32 * half);
      const __m512i b = t + 1 < longest ? _mm512_loadu_si512(row(t + 1) + 32 * half) : zero;
      _mm512_storeu_si512(dst + 64 * half, _mm512_permutex2var_epi16(a, even, b));
      _mm512_storeu_si512(dst + 64 * half + 32, _mm512_permutex2var_epi16(a, odd, b));
    }
  }
}

#ifdef KVSHARE_AMX
// Weighted values of 16 vectors on tiles: acc_out (16 x 64, float) = weights (16 x longest
// bfloat16, row stride ``stride``, zero past each vector's keys and up to the tile) times the
// values in pairs. Tiles: 0-3 the output's 16-dim quarters, 4 the weights of 32 keys, 5 their values.
void value_pass_amx(const c10::BFloat16* weights, int64_t stride, int64_t longest, const c10::BFloat16* pairs,
                    float* acc_out) {
  TileConfig config;
  for (int t = 0; t < 6; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  _tile_loadconfig(&config);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  constexpr int64_t kPairRow = 128 * sizeof(c10::BFloat16);
  for (int64_t t0 = 0; t0 < longest; t0 += 32) {
    const c10::BFloat16* v = pairs + t0 / 2 * 128;
    _tile_loadd(4, weights + t0, stride * sizeof(c10::BFloat16));
    _tile_loadd(5, v, kPairRow);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(5, v + 32, kPairRow);
    _tile_dpbf16ps(1, 4, 5);
    _tile_loadd(5, v + 64, kPairRow);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(5, v + 96, kPairRow);
    _tile_dpbf16ps(3, 4, 5);
  }
  constexpr int64_t kOutRow = 64 * sizeof(float);
  _tile_stored(0, acc_out, kOutRow);
  _tile_stored(1, acc_out + 16, kOutRow);
  _tile_stored(2, acc_out + 32, kOutRow);
  _tile_stored(3, acc_out + 48, kOutRow);
  _tile_release();
}

// chunk_scores_dpbf16 on tiles: tiles 1-2 the vectors' halves (16 vectors x 32 dims), 3-4 a
// block of 16 keys' halves in pairs, 0 the 16 x 16 scores, stored row by row into sc
void chunk_scores_amx(const c10::BFloat16* raw, const std::vector<uint32_t>& keys_t, int64_t longest, float* sc,
                      int64_t stride) {
  TileConfig config;
  for (int t = 0; t < 5; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  _tile_loadconfig(&config);
  _tile_loadd(1, raw, 64 * sizeof(c10::BFloat16));
  _tile_loadd(2, raw + 32, 64 * sizeof(c10::BFloat16));
  for (int64_t first = 0; first < longest; first += 16) {
    const uint32_t* block = keys_t.data() + first / 16 * 512;
    _tile_zero(0);
    _tile_loadd(3, block, 64);
    _tile_loadd(4, block + 256, 64);
    _tile_dpbf16ps(0, 1, 3);
    _tile_dpbf16ps(0, 2, 4);
    _tile_stored(0, sc + first, stride * sizeof(float));
  }
  _tile_release();
}

#endif  // KVSHARE_AMX

// Weighted values of 16 vectors, as value_pass_amx takes them (weights: 16 x longest bfloat16,
// row stride ``stride``, zero past each vector's keys and up to 32 keys; values in pairs), in
// AVX512-BF16 dot products: per pair of keys, 16 dims of both keys fill one register and each
// vector's two weights are broadcast against it; one quarter of the dims at a time, so that the
// 16 vectors' accumulators stay in registers.
void value_pass_dpbf16(const c10::BFloat16* weights, int64_t stride, int64_t longest, const c10::BFloat16* pairs,
                       float* acc_out) {
  const int64_t key_pairs = (longest + 31) / 32 * 16;
  for (int quarter = 0; quarter < 4; ++quarter) {
    __m512 acc[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < key_pairs; ++i) {
      const __m512bh v = (__m512bh)_mm512_loadu_si512(pairs + i * 128 + 32 * quarter);
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {
        const int32_t w = reinterpret_cast<const int32_t*>(weights + j * stride)[i];
        acc[j] = _mm512_dpbf16_ps(acc[j], v, (__m512bh)_mm512_set1_epi32(w));
      }
    }
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) _mm512_storeu_ps(acc_out + j * 64 + 16 * quarter, acc[j]);
  }
}

// Vectors [begin, end) of a prompt chunk's (sequence, KV head), 16 at a time, on AMX tiles
// (``on_tiles``) or in AVX512-BF16 dot products: scores as in decode, then the softmax weights
// rounded to bfloat16 for the value product (as PyTorch's CPU flash attention rounds them,
// which chunks took before), sums in float.
void attend_chunk(bool on_tiles, const c10::BFloat16* q, int64_t q_row, int64_t q_head, const Cache& kc, const Cache& vc,
                      const int32_t* table, int64_t block_size, const int32_t* row_lens, int64_t first_row,
                      int64_t begin, int64_t end, int64_t kv_head, int64_t ratio, float scale, c10::BFloat16* out,
                      int64_t out_row, int64_t out_head, std::vector<float>& scores,
                      std::vector<c10::BFloat16>& weights, std::vector<c10::BFloat16>& pairs,
                      std::vector<uint32_t>& keys_t) {
#ifndef KVSHARE_AMX
  TORCH_CHECK(!on_tiles, "this build has no AMX path");
#endif
  using BF16 = c10::BFloat16;
  const BF16* kbase = reinterpret_cast<const BF16*>(kc.base) + kv_head * kc.head;
  const BF16* vbase = reinterpret_cast<const BF16*>(vc.base) + kv_head * vc.head;
  const auto row_of = [&](int64_t vector) { return first_row + vector / ratio; };
  int64_t task_longest = 0;
  for (int64_t j = begin; j < end; ++j) task_longest = std::max<int64_t>(task_longest, row_lens[row_of(j)]);
  values_in_pairs(vbase, vc, table, block_size, task_longest, pairs);
  keys_in_pairs(kbase, kc, table, block_size, task_longest, keys_t);
  alignas(64) BF16 raw[kChunkGroup * 64];
  alignas(64) float acc[kChunkGroup * 64];
  for (int64_t first = begin; first < end; first += kChunkGroup) {
    const int64_t g = std::min<int64_t>(kChunkGroup, end - first);
    int64_t lens[kChunkGroup] = {}, longest = 0;
    std::fill(raw, raw + kChunkGroup * 64, BF16());
    for (int64_t j = 0; j < g; ++j) {
      const int64_t r = row_of(first + j), h = kv_head * ratio + (first + j) % ratio;
      lens[j] = row_lens[r];
      longest = std::max(longest, lens[j]);
      std::copy(q + r * q_row + h * q_head, q + r * q_row + h * q_head + 64, raw + j * 64);
    }
    if (longest == 0) {  // pad rows only
      for (int64_t j = 0; j < g; ++j) {
        const int64_t r = row_of(first + j), h = kv_head * ratio + (first + j) % ratio;
        std::fill(out + r * out_row + h * out_head, out + r * out_row + h * out_head + 64, BF16());
      }
      continue;
    }
    const int64_t padded = (longest + 31) / 32 * 32, stride = (longest + 15) / 16 * 16;
    if (static_cast<int64_t>(scores.size()) < kChunkGroup * stride) scores.resize(kChunkGroup * stride);
#ifdef KVSHARE_AMX
    if (on_tiles)
      chunk_scores_amx(raw, keys_t, longest, scores.data(), stride);
    else
#endif
      chunk_scores_dpbf16(raw, keys_t, longest, scores.data(), stride);
    float total[kChunkGroup];
    weights.assign(kChunkGroup * padded, BF16());
    for (int64_t j = 0; j < g; ++j)
      total[j] = softmax_to_weights(scores.data() + j * stride, lens[j], scale, weights.data() + j * padded);
#ifdef KVSHARE_AMX
    if (on_tiles)
      value_pass_amx(weights.data(), padded, longest, pairs.data(), acc);
    else
#endif
      value_pass_dpbf16(weights.data(), padded, longest, pairs.data(), acc);
    for (int64_t j = 0; j < g; ++j) {
      const int64_t r = row_of(first + j), h = kv_head * ratio + (first + j) % ratio;
      BF16* dst = out + r * out_row + h * out_head;
      const float inv = lens[j] > 0 ? 1.f / total[j] : 0.f;
      for (int64_t i = 0; i < 64; ++i) dst[i] = static_cast<BF16>(acc[j * 64 + i] * inv);
    }
  }
}
#endif

// Whether groups of this dtype and head size take the AMX path here
template <typename T, int D>
bool amx_applies() {
#ifdef KVSHARE_AMX
  if constexpr (std::is_same_v<T, c10::BFloat16> && D == 64) return amx_allowed();
#endif
  return false;
}

// How prompt chunks (rows > kChunkRows) of 64-dim heads run: SDPA outside the kernel, AMX
// tiles, or AVX512-BF16 dot products (bfloat16 only)
enum class ChunkPath { kNone, kTiles, kDotProducts };

template <typename T>
ChunkPath chunk_path() {
  if (amx_applies<T, 64>()) return ChunkPath::kTiles;
#ifdef KVSHARE_BF16_CHUNKS
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    if (dpbf16_wanted.load(std::memory_order_relaxed)) return ChunkPath::kDotProducts;
#endif
  return ChunkPath::kNone;
}

// The group function of a raw bfloat16 path (tiles or dot products), for the types it applies to
template <typename T>
void attend_group_raw(ChunkPath path, int64_t g, const T* raw_q, const int64_t* lens, int64_t longest, float scale,
                      const T* kbase, const T* vbase, const Cache& kc, const Cache& vc, const int32_t* table,
                      int64_t block_size, float* sc, float* total, float* acc_out) {
#ifdef KVSHARE_BF16_CHUNKS
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    (path == ChunkPath::kTiles ? bf16_group_fn<true>(g) : bf16_group_fn<false>(g))(
        raw_q, lens, longest, scale, kbase, vbase, kc, vc, table, block_size, sc, total, acc_out);
    return;
  }
#endif
  TORCH_CHECK(false, "no bfloat16 tile or dot-product path for this dtype");
}

// Every row of one sequence for one KV head, kGroup query vectors at a time; ``chunks`` is the
// call's bfloat16 64-dim path (run() decides it once per call)
template <typename T, int D>
void attend_task(ChunkPath chunks, const T* q, int64_t q_row, int64_t q_head, const Cache& kc, const Cache& vc,
                 const int32_t* table, int64_t block_size, const int32_t* row_lens, int64_t first_row,
                 int64_t rows, int64_t kv_head, int64_t ratio, int64_t head_dim, float scale, T* out,
                 int64_t out_row, int64_t out_head, std::vector<float>& scores) {
  const int64_t d = D ? D : head_dim;
  const T* kbase = reinterpret_cast<const T*>(kc.base) + kv_head * kc.head;
  const T* vbase = reinterpret_cast<const T*>(vc.base) + kv_head * vc.head;
  const int64_t vectors = rows * ratio;
  std::vector<float> qf(kGroup * d), acc(kGroup * d);
  ChunkPath path = D == 64 ? chunks : ChunkPath::kNone;  // few-row groups take the chunks' path, except:
  // a single row per sequence is bound by reading K/V, and there the generic path measured faster than dot
  // products (0.93x), which pay off from an ICaRus pair on (1.10x; results/cpu-attention/session20)
  if (path == ChunkPath::kDotProducts && rows == 1) path = ChunkPath::kNone;
  std::vector<T> raw(path != ChunkPath::kNone ? kGroup * d : 0);
  T* raw_q = path != ChunkPath::kNone ? raw.data() : nullptr;  // those paths take the query vectors as they are
  for (int64_t first = 0; first < vectors; first += kGroup) {
    const int64_t g = std::min<int64_t>(kGroup, vectors - first);
    int64_t lens[kGroup], longest = 0;
    for (int64_t j = 0; j < g; ++j) {
      const int64_t r = first_row + (first + j) / ratio, h = kv_head * ratio + (first + j) % ratio;
      lens[j] = row_lens[r];
      longest = std::max(longest, lens[j]);
      const T* src = q + r * q_row + h * q_head;
      if (raw_q)
        std::copy(src, src + d, raw_q + j * d);
      else
        for (int64_t i = 0; i < d; ++i) qf[j * d + i] = to_float(src[i]) * scale;
    }
    if (static_cast<int64_t>(scores.size()) < g * longest) scores.resize(g * longest);
    float total[kGroup];
    if (raw_q)
      attend_group_raw(path, g, raw_q, lens, longest, scale, kbase, vbase, kc, vc, table, block_size, scores.data(),
                       total, acc.data());
    else
      (D ? group_fn<T, D>(g) : attend_group<T, 0, 0>)(qf.data(), lens, longest, g, d, kbase, vbase, kc, vc, table,
                                                      block_size, scores.data(), total, acc.data());
    for (int64_t j = 0; j < g; ++j) {
      const int64_t r = first_row + (first + j) / ratio, h = kv_head * ratio + (first + j) % ratio;
      T* dst = out + r * out_row + h * out_head;
      const float inv = lens[j] > 0 ? 1.f / total[j] : 0.f;
      for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(acc[j * d + i] * inv);
    }
  }
}

// One task: vectors [begin, end) (rows x the query heads sharing the KV head) of a sequence's KV
// head, and its cost: the keys its vectors read
struct Task {
  int64_t seq, kv_head, begin, end, cost;
};

// The step's tasks, costliest first (handed out in that order, they finish close together): a
// (sequence, KV head) each, a prompt chunk's split in runs of whole groups so that every core
// shares even a single chunk, and a causal chunk's cheap early rows balance its late ones
std::vector<Task> make_tasks(const int32_t* seq, int64_t n, const int32_t* starts, const int32_t* row_lens,
                             int64_t kv_heads, int64_t ratio, bool chunks_in_kernel) {
  std::vector<Task> tasks;
  const int64_t pieces = std::max<int64_t>(1, 8 * at::get_num_threads() / kv_heads);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = seq[i], rows = starts[s + 1] - starts[s], vectors = rows * ratio;
    int64_t span = vectors;
    if (chunks_in_kernel && rows > kChunkRows)
      span = std::max<int64_t>(kChunkGroup, (vectors + pieces - 1) / pieces / kChunkGroup * kChunkGroup);
    for (int64_t b = 0; b < vectors; b += span) {
      const int64_t e = std::min(vectors, b + span);
      int64_t cost = 0;
      for (int64_t v = b; v < e; ++v) cost += row_lens[starts[s] + v / ratio];
      for (int64_t h = 0; h < kv_heads; ++h) tasks.push_back({s, h, b, e, cost});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  return tasks;
}

template <typename T>
void run(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
         const torch::Tensor& tables, const torch::Tensor& starts, const torch::Tensor& row_lens,
         const torch::Tensor& seqs, double scale, torch::Tensor& out) {
  const int64_t heads = q.size(1), d = q.size(2), kv_heads = k_cache.size(2), block_size = k_cache.size(1);
  const int64_t ratio = heads / kv_heads, n = seqs.size(0), width = tables.size(1);
  const Cache kc{reinterpret_cast<const char*>(k_cache.data_ptr<T>()), k_cache.stride(0), k_cache.stride(1),
                 k_cache.stride(2)};
  const Cache vc{reinterpret_cast<const char*>(v_cache.data_ptr<T>()), v_cache.stride(0), v_cache.stride(1),
                 v_cache.stride(2)};
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* sp = starts.data_ptr<int32_t>();
  const int32_t* lp = row_lens.data_ptr<int32_t>();
  const ChunkPath chunks = d == 64 ? chunk_path<T>() : ChunkPath::kNone;
  const std::vector<Task> tasks =
      make_tasks(seqs.data_ptr<int32_t>(), n, sp, lp, kv_heads, ratio, chunks != ChunkPath::kNone);
  std::atomic<int64_t> next{0};  // tasks are uneven (a chunk's later rows read more keys): hand them out
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> scores;
    [[maybe_unused]] std::vector<c10::BFloat16> weights, pairs;
    [[maybe_unused]] std::vector<uint32_t> keys_t;
    for (int64_t i = next++; i < static_cast<int64_t>(tasks.size()); i = next++) {
      const Task& task = tasks[i];
      const int64_t s = task.seq, h = task.kv_head, rows = sp[s + 1] - sp[s];
#ifdef KVSHARE_BF16_CHUNKS
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (chunks != ChunkPath::kNone && rows > kChunkRows) {
          attend_chunk(chunks == ChunkPath::kTiles, qp, q.stride(0), q.stride(1), kc, vc, tp + s * width, block_size,
                       lp, sp[s], task.begin, task.end, h, ratio, static_cast<float>(scale), op, out.stride(0),
                       out.stride(1), scores, weights, pairs, keys_t);
          continue;
        }
      }
#endif
      auto task_fn = d == 64 ? attend_task<T, 64> : d == 128 ? attend_task<T, 128> : attend_task<T, 0>;
      task_fn(chunks, qp, q.stride(0), q.stride(1), kc, vc, tp + s * width, block_size, lp, sp[s], rows, h, ratio, d,
              static_cast<float>(scale), op, out.stride(0), out.stride(1), scores);
    }
  });
}

}  // namespace

// q, out: (rows, heads, d), rows grouped by sequence; k_cache, v_cache: (blocks, block_size,
// kv_heads, d) views with a contiguous last dim; tables: (sequences, width) int32 block ids;
// starts: (sequences + 1) int32 first row of each sequence; row_lens: (rows,) int32 keys each
// row reads; seqs: int32 the sequences to compute (their rows of out are written, no other).
void paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                     torch::Tensor starts, torch::Tensor row_lens, torch::Tensor seqs, double scale,
                     torch::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && q.stride(2) == 1 && out.stride(2) == 1,
              "q and out: (rows, heads, d) with a contiguous last dim");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.stride(3) == 1 &&
                  v_cache.stride(3) == 1 && k_cache.size(3) == q.size(2),
              "k_cache and v_cache: (blocks, block_size, kv_heads, d) with a contiguous last dim");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(q.size(2) <= 1024, "head size above 1024");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == q.scalar_type() &&
                  out.scalar_type() == q.scalar_type(),
              "q, caches and out share one dtype");
  for (const auto* t : {&tables, &starts, &row_lens, &seqs})
    TORCH_CHECK(t->scalar_type() == torch::kInt32 && t->is_contiguous(), "index tensors: contiguous int32");
  switch (q.scalar_type()) {
    case torch::kFloat32: run<float>(q, k_cache, v_cache, tables, starts, row_lens, seqs, scale, out); break;
    case torch::kBFloat16: run<c10::BFloat16>(q, k_cache, v_cache, tables, starts, row_lens, seqs, scale, out); break;
    case torch::kFloat16: run<c10::Half>(q, k_cache, v_cache, tables, starts, row_lens, seqs, scale, out); break;
    default: TORCH_CHECK(false, "paged_attention takes float32, bfloat16 or float16");
  }
}

// Rows above which a sequence is a prompt chunk (FEW_ROWS on the Python side)
int64_t paged_attention_chunk_rows() { return kChunkRows; }

// Whether bfloat16 caches with 64-dim heads take the AMX path on this machine (prompt chunks too)
bool paged_attention_uses_amx() { return amx_applies<c10::BFloat16, 64>(); }

// Let them take it where the machine allows (the default) or not: the generic path
void paged_attention_set_amx(bool on) {
#ifdef KVSHARE_AMX
  amx_wanted.store(on, std::memory_order_relaxed);
#endif
}

// How bfloat16 prompt chunks with 64-dim heads run here: "amx" (tiles), "avx512bf16" (dot
// products) or "" (SDPA, outside the kernel)
std::string paged_attention_chunk_path() {
  switch (chunk_path<c10::BFloat16>()) {
    case ChunkPath::kTiles: return "amx";
    case ChunkPath::kDotProducts: return "avx512bf16";
    default: return "";
  }
}

// Let chunks take AVX512-BF16 dot products where AMX is not used (the default) or not: SDPA
void paged_attention_set_dpbf16(bool on) {
#ifdef KVSHARE_BF16_CHUNKS
  dpbf16_wanted.store(on, std::memory_order_relaxed);
#endif
}
