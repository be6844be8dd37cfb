// Skinny GEMMs for decode-sized batches (a few rows, the tiles of gemm_blocks.h), and the
// bandwidth probe; fp32 activations against fp32, bf16 or int8 weights (widened in registers, see
// tiles.h). Built into the same library as kda_cpu.cpp (build.py) and tested against the
// plain-torch references in kdaserve/kernels/ref.

#include <algorithm>
#include <cmath>
#include <cstdint>
#if defined(__x86_64__)
#include <immintrin.h>
#include <omp.h>
#endif
#include <memory>
#include <type_traits>
#include <vector>

extern "C" {
// amx_cpu.cpp
int64_t linear_amx_ready();
int64_t linear_amx_bf16w(const float* x, const uint16_t* w, float* y, int64_t M, int64_t N,
                         int64_t K, int64_t team);
int64_t linear_amx_int8w(const float* x, const int8_t* w, const float* scale, float* y,
                         int64_t M, int64_t N, int64_t K, int64_t team);
}

namespace {

#include "tiles.h"
#include "gemm_blocks.h"

// scale (nullable) [N]: int8 weights' per-row scales, applied to each panel's columns as
// they go from the panel's y^T into y.
template <typename W>
void linear_bcast(const float* x, const W* w, const float* scale, float* y, int64_t M,
                  int64_t N, int64_t K) {
  const int64_t Mp = round_up(M, kLanes);
  std::unique_ptr<float[]> xt(new float[K * Mp]);  // every element written below
  const int64_t panels = (N + kBN - 1) / kBN;
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t k0 = 0; k0 < K; k0 += 8)
      fill_xt(x, [K](int64_t m) { return m * K; }, M, K, Mp, kXB, xt.get(), k0,
              std::min(K, k0 + 8));
    std::vector<float> wide(std::is_same_v<W, float> ? 0 : kBN * K), yt(kBN * Mp);
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t n0 = p * kBN, rows = std::min<int64_t>(kBN, N - n0);
      bcast_rows(w + n0 * K, rows, K, xt.get(), Mp, kXB, yt.data(), wide.data());
      for (int64_t m = 0; m < M; ++m)
        for (int64_t i = 0; i < rows; ++i)
          y[m * N + n0 + i] = yt[i * Mp + m] * (scale != nullptr ? scale[n0 + i] : 1.0f);
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// fp32 weights against 4-24 x rows (a verify's 8 tokens, a drafter's 7, a batch of 8): the
// dot tiles above reach ~65-100 GFLOP/s there (their 4 x 4 tiles end in a horizontal sum per
// output) and linear_bcast's 48-row tiles would be mostly padding. Here x^T is held in 8-lane
// vectors (one per 8 rows, up to three) and each weight element is broadcast into them, as in
// linear_bcast: no horizontal sums, and 8 weight rows stream at once, the next 8 prefetched.
// 2-core Zen 4, fp32, ms old / new: the 100k x 768 lm_head at 7 / 8 / 12 / 15 rows 16.3 /
// 18.2 / 24.4 / 29.1 -> 9.2 / 9.4 / 12.5 / 12.6 (8 rows as fast as 1: the weight's read);
// 2304 x 768 in cache 0.26 / 0.29 / 0.43 / 0.54 -> 0.16 / 0.16 / 0.25 / 0.25. At 4 rows,
// weights cycled past the L3: the lm_head 17.5 -> 11.1, 3072 x 768 0.44 -> 0.34, 768 x 2048
// 0.27 -> 0.30, 384 x 768 0.065 -> 0.070. From 17 to 24 rows (three vectors) against
// linear_bcast: the lm_head at 24 rows 28.7 -> 21.1, 3072 x 768 0.85 -> 0.57 (768 x 2048 the
// same). 8-lane vectors are AVX2's own width, and on AVX2 linear_bcast's 8-lane tiles take 9
// rows on; on Intel's AVX-512 (two 512-bit FMA ports, 256-bit ones at half the rate) not yet
// measured. int8 weights keep widening in registers.
#if defined(__AVX512F__)
constexpr int64_t kNarrowFrom = 4, kNarrowTo = 24;
#else
constexpr int64_t kNarrowFrom = 5, kNarrowTo = 8;  // AVX2's 4 streamed rows were faster
#endif
// bf16 weights take the same tiles, each element broadcast from its two bytes (a 16-bit
// broadcast masked to the upper half of each lane: the fp32 value). From 6 rows on AVX-512,
// 16 for inputs wider than 1,024 (where x^T outgrows L1): below, the dot tiles widening in
// registers (and the BF16 dot streams to 4 rows) are ahead. 2-core Zen 4, ms, weights cycled
// past the L3, dot tiles / these at 5 / 6 / 8 / 12 / 16 / 24 rows: the 100k x 768 lm_head
// 9.3 / 10.4 / 11.2 / 15.1 / 20.0 / 24.0 -> 9.6 / 9.7 / 9.6 / 12.5 / 12.4 / 17.7 (fp32's
// narrow tiles 13.0 at 16); 3072 x 768 0.34 / 0.34 / 0.37 / 0.51 / 0.64 / 0.76 -> 0.34 / 0.33
// / 0.32 / 0.40 / 0.40 / 0.56; 768 x 2048 0.16 / 0.19 / 0.21 / 0.28 / 0.43 / 0.61 -> 0.33 /
// 0.33 / 0.36 / 0.38 / 0.39 / 0.52. (Before, bf16 weights were widened 8 rows at a time into
// an fp32 buffer, from 17 rows only; BF16 dots on x^T split in two bf16 parts were slower
// still: two dots per weight pair.) AVX2 keeps its widening tiles (not measured there).
#if defined(__AVX512F__)
constexpr int64_t kNarrowFromBf16 = 6, kNarrowFromBf16Wide = 16, kWideInput = 1024;
#else
constexpr int64_t kNarrowFromBf16 = kNarrowTo + 1, kNarrowFromBf16Wide = kNarrowTo + 1,
                  kWideInput = 0;
#endif
constexpr int kNarrowN = 8;  // weight rows per tile: 8 x V accumulators

inline __m256 bcast_weight(const float* w) { return _mm256_broadcast_ss(w); }
inline __m256 bcast_weight(const bf16* w) {
  return _mm256_castsi256_ps(_mm256_and_si256(
      _mm256_set1_epi16(static_cast<short>(*w)), _mm256_set1_epi32(int32_t(0xFFFF0000u))));
}

// yt [TN, 8 V] = TN weight rows (stride K) against x^T [K, 8 V]; pf (nullable): the next
// tile's rows, a cache line of each fetched per 16 k. Always inlined: called, GCC kept the
// two-vector tile's accumulators in memory (3x slower).
template <int TN, int V, typename W>
[[gnu::always_inline]] inline void narrow_tile(const W* __restrict w, int64_t K,
                                               const float* __restrict xt,
                                               float* __restrict yt, const W* pf) {
  __m256 acc[TN][V];
  for (int i = 0; i < TN; ++i)
    for (int v = 0; v < V; ++v) acc[i][v] = _mm256_setzero_ps();
  for (int64_t kb = 0; kb < K; kb += 16) {
    if (pf != nullptr)
      for (int i = 0; i < TN; ++i) __builtin_prefetch(pf + i * K + kb, 0, 3);
    const int64_t ke = std::min(K, kb + 16);
#pragma GCC unroll 4
    for (int64_t k = kb; k < ke; ++k) {
      __m256 xv[V];
      for (int v = 0; v < V; ++v) xv[v] = _mm256_loadu_ps(xt + (k * V + v) * 8);
      for (int i = 0; i < TN; ++i) {
        const __m256 b = bcast_weight(w + i * K + k);
        for (int v = 0; v < V; ++v) acc[i][v] = _mm256_fmadd_ps(b, xv[v], acc[i][v]);
      }
    }
  }
  for (int i = 0; i < TN; ++i)
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(yt + (i * V + v) * 8, acc[i][v]);
}

// Rows [n0, n0 + TN) of y [M, N] from a tile, the next tile's rows prefetched.
template <int TN, int V, typename W>
[[gnu::always_inline]] inline void narrow_out(const W* w, int64_t K, const float* xt,
                                              float* y, int64_t M, int64_t N, int64_t n0,
                                              bool last) {
  float yt[TN * V * 8];
  narrow_tile<TN, V>(w + n0 * K, K, xt, yt, last ? nullptr : w + (n0 + TN) * K);
  for (int64_t m = 0; m < M; ++m)
    for (int i = 0; i < TN; ++i) y[m * N + n0 + i] = yt[i * V * 8 + m];
}

template <int V, typename W>
void linear_narrow(const float* x, const W* w, float* y, int64_t M, int64_t N, int64_t K) {
  std::unique_ptr<float[]> xt(new float[K * V * 8]);  // x^T, zero-padded to 8 V columns
  for (int64_t k = 0; k < K; ++k)
    for (int64_t m = 0; m < V * 8; ++m) xt[k * V * 8 + m] = m < M ? x[m * K + k] : 0.0f;
  const int64_t tiles = N / kNarrowN;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tiles; ++t)  // each thread a run of tiles, prefetching the next
    narrow_out<kNarrowN, V>(w, K, xt.get(), y, M, N, t * kNarrowN, t + 1 == tiles);
  const int64_t n0 = tiles * kNarrowN;
  switch (N - n0) {  // the last rows, kept together (one-row tiles: too few FMA chains)
    case 0: break;
    case 1: narrow_out<1, V>(w, K, xt.get(), y, M, N, n0, true); break;
    case 2: narrow_out<2, V>(w, K, xt.get(), y, M, N, n0, true); break;
    case 3: narrow_out<3, V>(w, K, xt.get(), y, M, N, n0, true); break;
    case 4: narrow_out<4, V>(w, K, xt.get(), y, M, N, n0, true); break;
    case 5: narrow_out<5, V>(w, K, xt.get(), y, M, N, n0, true); break;
    case 6: narrow_out<6, V>(w, K, xt.get(), y, M, N, n0, true); break;
    default: narrow_out<7, V>(w, K, xt.get(), y, M, N, n0, true); break;
  }
}
#else
constexpr int64_t kNarrowFrom = 1, kNarrowTo = 0;  // none
#endif

// bf16 weights go to AMX tiles (amx_cpu.cpp) from this many rows, where the host has them;
// from 8 for lm_head-sized weights (kLargeWeight elements, ops.LARGE_WEIGHT). Measured against
// this file's tiles (ms, 2-core Sapphire Rapids, median of alternated calls): 2304 x 768 at 4 /
// 8 / 16 / 64 rows 0.26 / 0.28 / 0.30 / 0.94 AMX, 0.18 / 0.31 / 0.67 / 1.81 here; 768 x 2048
// 0.22 / 0.26 / 0.25 / 0.86 against 0.13 / 0.24 / 0.58 / 1.71; the 100k x 768 lm_head at 4 /
// 8 / 16 17.5 / 18.2 / 19.5 against 14.0 / 21.2 / 33.0.
constexpr int64_t kAmxFrom = 16, kAmxFromLarge = 8;
constexpr int64_t kLargeWeight = int64_t{16} << 20;

// scale (nullable) [N]: multiplies output column n (int8 weights' per-row scales).
template <typename W>
void linear_small(const float* x, const W* w, const float* scale, float* y, int64_t M,
                  int64_t N, int64_t K) {
  if constexpr (std::is_same_v<W, bf16>) {
    if (M >= (N * K >= kLargeWeight ? kAmxFromLarge : kAmxFrom) && linear_amx_ready() == 1 &&
        linear_amx_bf16w(x, w, y, M, N, K, 1) == 0)
      return;
  }
  // int8 from the same row counts (converted to bf16 panels on the way; at 16 rows 2304 x 768
  // took 0.80 ms widened in registers, 0.48 fp32 and 0.30 bf16 on the tiles)
  if constexpr (std::is_same_v<W, int8_t>) {
    if (M >= (N * K >= kLargeWeight ? kAmxFromLarge : kAmxFrom) && linear_amx_ready() == 1 &&
        linear_amx_int8w(x, w, scale, y, M, N, K, 1) == 0)
      return;
  }
  constexpr int64_t kRows = 64;
#if defined(KDASERVE_BF16_DOTS)
  // 1-4 rows of bf16 weights on the BF16 dot instruction (gemm_blocks.h); x split once here
  if constexpr (std::is_same_v<W, bf16>) {
    if (M <= kDotBf16Rows) {
      std::vector<bf16> split(2 * M * K);
      split_bf16(x, M * K, split.data(), split.data() + M * K);
#pragma omp parallel for schedule(static)
      for (int64_t n0 = 0; n0 < N; n0 += kRows)
        stream_rows_bf16(x, split.data(), split.data() + M * K, w + n0 * K, y, M, N, K, n0,
                         std::min(N, n0 + kRows));
      return;
    }
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<W, float> || std::is_same_v<W, bf16>) {
    const int64_t from = std::is_same_v<W, float> ? kNarrowFrom
                         : K > kWideInput                ? kNarrowFromBf16Wide
                                                         : kNarrowFromBf16;
    if (M >= from && M <= kNarrowTo)
      return M <= 8 ? linear_narrow<1>(x, w, y, M, N, K)
             : M <= 16 ? linear_narrow<2>(x, w, y, M, N, K)
                       : linear_narrow<3>(x, w, y, M, N, K);
  }
#endif
  if (M >= std::max<int64_t>(kLanes, kFewM + 1)) return linear_bcast(x, w, scale, y, M, N, K);
// bf16 and int8 weights widen in registers at every row count: widening each block into an
// fp32 buffer first (the earlier way) made them 1.5-2x slower from 4 rows on.
#pragma omp parallel for schedule(static)
  for (int64_t n0 = 0; n0 < N; n0 += kRows) {
    const int64_t n1 = std::min(N, n0 + kRows);
    linear_block(x, w + n0 * K, y, M, N, K, n0, n1);
    if (scale != nullptr)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = n0; n < n1; ++n) y[m * N + n] *= scale[n];
  }
}

}  // namespace

extern "C" {

void linear_small_f32(const float* x, const float* w, float* y, int64_t M, int64_t N,
                      int64_t K) {
  linear_small(x, w, static_cast<const float*>(nullptr), y, M, N, K);
}

void linear_small_bf16w(const float* x, const bf16* w, float* y, int64_t M, int64_t N,
                        int64_t K) {
  linear_small(x, w, static_cast<const float*>(nullptr), y, M, N, K);
}

void linear_small_int8w(const float* x, const int8_t* w, const float* scale, float* y,
                        int64_t M, int64_t N, int64_t K) {
  linear_small(x, w, scale, y, M, N, K);
}

// Sum of n floats over the OpenMP team: the streaming-read probe of bench/roofline.py (the
// result only keeps the loop from being optimised away). 8-float vectors with 8 accumulators:
// measured 48 GB/s here where the 16-float vector type of the kernels above reached 30 (GCC
// lowers it to AVX2 pairs and the loop stalls on them). `streams`: each thread reads its share
// as that many interleaved sequential streams, 256 bytes of each in turn, as a matrix-vector
// kernel walks several weight rows at once: on some hosts (a Zen 4 VM) more streams per core
// read faster than one, and the probe must find the machine's best, not one pattern's.
float read_f32(const float* x, int64_t n, int64_t streams) {
  typedef float v8 __attribute__((vector_size(32)));
  float total = 0.0f;
  const int64_t blocks = n / 64;
  if (streams < 1) streams = 1;
#pragma omp parallel reduction(+ : total)
  {
    v8 acc[8] = {};
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t lo = blocks * t / nt, hi = blocks * (t + 1) / nt;
    const int64_t per = (hi - lo) / streams;  // blocks of each stream
    for (int64_t i = 0; i < per; ++i)
      for (int64_t s = 0; s < streams; ++s) {
        const float* p = x + 64 * (lo + s * per + i);
        for (int j = 0; j < 8; ++j) {
          v8 v;
          __builtin_memcpy(&v, p + 8 * j, sizeof(v));
          acc[j] += v;
        }
      }
    for (int64_t i = lo + per * streams; i < hi; ++i)  // what the streams left
      for (int j = 0; j < 8; ++j) {
        v8 v;
        __builtin_memcpy(&v, x + 64 * i + 8 * j, sizeof(v));
        acc[j] += v;
      }
    for (int j = 1; j < 8; ++j) acc[0] += acc[j];
    for (int l = 0; l < 8; ++l) total += acc[0][l];
  }
  for (int64_t i = blocks * 64; i < n; ++i) total += x[i];
  return total;
}

}  // extern "C"
