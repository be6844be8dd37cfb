// The GEMM building blocks of the native library's sources (gemm_cpu.cpp, moe_cpu.cpp):
// weight rows streamed and dotted for a few x rows, and broadcast tiles against x^T for
// more. Included inside each source's anonymous namespace, after tiles.h.

#pragma once

// y [M, N] = x [M, K] @ w [N, K]^T for a few rows (decode). MKL's sgemm packs w on every
// call, which on these shapes reaches about a third of the memory bandwidth (measured on the
// 100k x 768 lm_head: 11.7 GB/s against 30+ here). Here each block of weight rows is streamed
// once per call and dotted with the x rows in register tiles while it sits in L2.
//
// Up to kFewM x rows the product is bandwidth-bound: the weight rows are read one after the
// other (one sequential stream, which the prefetchers follow best), each dotted with every x
// row in kUnroll independent partial sums (a single running sum per dot stalls on the add
// latency: bf16 weights streamed at ~37 GB/s, int8 at ~30, on a host reading 70+). More x
// rows make it compute-bound: kTileN x kTileM tiles. On AVX2 the tiles hold one x row
// (kTileM 1), so from 4 rows they re-read, and for bf16 / int8 re-widen, each weight vector
// per x row; streaming up to 8 rows (8 sums and a weight of 16 registers) was faster at every
// count (AVX2 AMD EPYC, 2304 x 768 weights cycled past the L3, ms at 2 / 4 / 7 / 8 rows:
// fp32 0.41 / 0.37 / 0.80 / 0.46 -> 0.34 / 0.30 / 0.49 / 0.39, int8 0.15 / 0.29 / 0.47 / 0.52
// -> 0.12 / 0.16 / 0.28 / 0.31, bf16 0.20 / 0.39 / 0.63 / 0.78 -> 0.16 / 0.20 / 0.30 / 0.48;
// from 12 rows fp32's broadcast tiles win).
#if defined(__AVX512F__)
constexpr int kFewM = 3;
#else
constexpr int kFewM = 8;
#endif
constexpr int kUnroll = 2;
// Each step also prefetches its weights' cache lines this many bytes ahead: one sequential
// stream per core did not keep enough reads in flight for bf16 and int8 weights, which take
// more instructions per byte (the 100k x 768 lm_head at 1 row, library variants alternated
// call by call on a Xeon whose read bandwidth was ~15-23 GB/s: bf16 11.4 -> 14.7 GB/s, int8
// 11.3 -> 14.5, fp32 15.8 -> 16.6; 512 bytes ahead was no better than none, 2-4 KB no better
// than 1). The prefetch is a plain one (into every cache level), not a non-temporal one: on
// Sapphire Rapids prefetchnta kept what it fetched out of L2 and at the L3's eviction end, so
// weights that would have stayed in the L3 from one step to the next came from memory again
// (a hidden-256 MoE, 53 MB, decode step at batch 1 4.2 -> 1.9 ms); streaming weights larger
// than the L3 gained too (`bench` batch-1 steps fp32 31-33 -> 27-29 ms, bf16 18-20 -> 16-18,
// int8 13-14 -> 10-12; the 100k x 768 lm_head at 1 row, bf16 13.3 -> 14.8 GB/s). fp32
// weights run a little better half as far ahead on an AVX2 AMD EPYC (`bench` batch-1 decode
// steps, libraries alternated step by step, 1,024 -> 512 bytes, six runs: -5.4, -2.7, -1.6,
// -0.2, -0.6, -1.3%; bf16 and int8 at 512 were 4-5% slower, fp32 at 2-4 KB 4-7% slower).
template <typename W>
constexpr int kStreamAhead = sizeof(W) == 4 ? 512 : 1024;

template <int TM, typename W>
inline void dot_stream(const W* __restrict w, const float* __restrict x, float* __restrict y,
                       int64_t N, int64_t K) {
  // bf16 and int8 weights take more instructions per weight (widening), so their dots need
  // more independent sums to keep the FMA units busy at the stream's rate: with two, int8
  // weights in cache ran at ~24 GB/s, below the ~26 GB/s memory read of this AVX2 host, so a
  // stream from memory was compute-bound (eight: 32 GB/s in cache; cycled past the L3, the
  // 100k x 768 lm_head 16.8-18.5 -> 19.9-21.9 GB/s, 2304 x 768 15.8-16.9 -> 19.0-20.4).
  // Up to four x rows; above, one sum per row (the registers).
  constexpr int kU = TM > 4 ? 1
                     : sizeof(W) == 1 ? (TM == 1 ? 8 : TM == 2 ? 4 : 2)
                     : sizeof(W) == 2 ? (TM == 1 ? 4 : 2)
                                      : kUnroll;
  vtile acc[kU][TM] = {};
  int64_t j = 0;
  for (; j + kU * kLanes <= K; j += kU * kLanes) {
    // every cache line of this step's weights, kStreamAhead bytes on (into the next rows)
    const char* ahead = reinterpret_cast<const char*>(w + j) + kStreamAhead<W>;
    for (size_t b = 0; b < kU * kLanes * sizeof(W); b += 64)
      __builtin_prefetch(ahead + b, 0, 3);
    for (int u = 0; u < kU; ++u) {
      const vtile wv = load_tile(w + j + u * kLanes);
      for (int tm = 0; tm < TM; ++tm) acc[u][tm] += wv * load_tile(x + tm * K + j + u * kLanes);
    }
  }
  for (; j + kLanes <= K; j += kLanes) {
    const vtile wv = load_tile(w + j);
    for (int tm = 0; tm < TM; ++tm) acc[0][tm] += wv * load_tile(x + tm * K + j);
  }
  for (int tm = 0; tm < TM; ++tm) {
    vtile a = acc[0][tm];
    for (int u = 1; u < kU; ++u) a += acc[u][tm];
    float sum = hsum_tree(a);
    for (int64_t l = j; l < K; ++l) sum += widen(w[l]) * x[tm * K + l];
    y[tm * N] = sum;
  }
}

template <int TM, typename W>
void few_rows(const float* x, const W* wb, float* y, int64_t N, int64_t K, int64_t n0,
              int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) dot_stream<TM>(wb + (n - n0) * K, x, y + n, N, K);
}

constexpr int64_t kDotBf16Rows = 4;  // x rows up to which bf16 weights take the dots below
// Asked for by the build (build.py: isa.bf16_dots()) where the dots pay: on a Sapphire Rapids
// Xeon they ran slower than widening (one row, weights in L2, one thread: 31.9 against 36.0
// GB/s; four rows 10.3 against 23.2; streamed from memory 17-18 against 18-20 GB/s), a
// VDPBF16PS every ~2.4 cycles; AMD's Zen 4 issues one a cycle.
#if defined(__AVX512BF16__) && defined(KDASERVE_WANT_BF16_DOTS)
#define KDASERVE_BF16_DOTS 1
// bf16 weights against a few x rows with the BF16 dot instruction (AVX512_BF16: Zen 4, Cooper
// Lake, Sapphire Rapids), where the dot above widens every weight vector first (a zero-extend
// and a shift per 16 weights before the FMA). VDPBF16PS multiplies 32 bf16 pairs into 16 fp32
// sums at once, but takes bf16 activations: rounding them would put a 2^-9 relative error on
// every product (llama.cpp does that), so, as on the AMX tiles (amx_cpu.cpp), each x is split
// into hi = bf16(x) and lo = bf16(x - hi), both dotted with the same weights (error <= 2^-17
// |x|, ~1/256 of the weights' own rounding; the products of two bf16 values are exact and the
// sums fp32). Per 32 weights: one load and two dots instead of two widenings and two FMAs.
constexpr bool kDotBf16 = true;

// hi, lo [n] = the split of x [n]; the x rows of a call are split once, before its dots.
inline void split_bf16(const float* x, int64_t n, bf16* hi, bf16* lo) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + 16);
    const __m512i h = (__m512i)(_mm512_cvtne2ps_pbh(b, a));  // a low, b high
    const __m512 ha = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
    const __m512 hb = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
    const __m512i l = (__m512i)(
        _mm512_cvtne2ps_pbh(_mm512_sub_ps(b, hb), _mm512_sub_ps(a, ha)));
    _mm512_storeu_si512(hi + i, h);
    _mm512_storeu_si512(lo + i, l);
  }
  for (; i < n; ++i) {  // round to nearest even, as VCVTNE2PS2BF16 (no NaN among activations)
    const auto round = [](float f) {
      uint32_t u;
      __builtin_memcpy(&u, &f, sizeof(u));
      return static_cast<bf16>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
    };
    hi[i] = round(x[i]);
    lo[i] = round(x[i] - widen(hi[i]));
  }
}

// dot_stream's contract for bf16 weights, x given split (xh, xl: TM rows of K) and whole (x:
// for the last K % 32 elements). Unlike dot_stream it issues no prefetches: on the Zen 4 host
// these dots are built for, the hardware prefetchers alone kept more reads in flight (2-core
// AMD EPYC, AVX-512-BF16; the 100k x 768 lm_head at 1 row, standalone, alternated in one
// process, four runs: 26.8 / 29.5 / 30.1 / 31.5 GB/s with the 1 KB-ahead prefetch, 28.6 / 31.4
// / 36.6 / 44.4 without; `bench` preset bf16 decode steps, builds alternated process by
// process, four pairs: 10.1-11.8 -> 8.1-9.4 ms).
template <int TM>
inline void dot_stream_bf16(const bf16* __restrict w, const bf16* __restrict xh,
                            const bf16* __restrict xl, const float* __restrict x,
                            float* __restrict y, int64_t N, int64_t K) {
  constexpr int kU = TM == 1 ? 4 : 2;  // independent sums per x part (the dot's latency)
  __m512 acc[2][kU][TM];
  for (auto& part : acc)
    for (auto& row : part)
      for (auto& a : row) a = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + kU * 32 <= K; j += kU * 32) {
    for (int u = 0; u < kU; ++u) {
      const __m512bh wv = (__m512bh)(_mm512_loadu_si512(w + j + u * 32));
      for (int tm = 0; tm < TM; ++tm) {
        const int64_t at = tm * K + j + u * 32;
        acc[0][u][tm] = _mm512_dpbf16_ps(
            acc[0][u][tm], (__m512bh)(_mm512_loadu_si512(xh + at)), wv);
        acc[1][u][tm] = _mm512_dpbf16_ps(
            acc[1][u][tm], (__m512bh)(_mm512_loadu_si512(xl + at)), wv);
      }
    }
  }
  for (; j + 32 <= K; j += 32) {
    const __m512bh wv = (__m512bh)(_mm512_loadu_si512(w + j));
    for (int tm = 0; tm < TM; ++tm) {
      acc[0][0][tm] = _mm512_dpbf16_ps(
          acc[0][0][tm], (__m512bh)(_mm512_loadu_si512(xh + tm * K + j)), wv);
      acc[1][0][tm] = _mm512_dpbf16_ps(
          acc[1][0][tm], (__m512bh)(_mm512_loadu_si512(xl + tm * K + j)), wv);
    }
  }
  for (int tm = 0; tm < TM; ++tm) {
    __m512 a = _mm512_add_ps(acc[0][0][tm], acc[1][0][tm]);
    for (int u = 1; u < kU; ++u) a = _mm512_add_ps(a, _mm512_add_ps(acc[0][u][tm], acc[1][u][tm]));
    float sum = _mm512_reduce_add_ps(a);
    for (int64_t l = j; l < K; ++l) sum += widen(w[l]) * x[tm * K + l];
    y[tm * N] = sum;
  }
}

// few_rows for bf16 weights and split x rows; TM 1-4.
template <int TM>
void few_rows_bf16(const float* x, const bf16* xh, const bf16* xl, const bf16* wb, float* y,
                   int64_t N, int64_t K, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) dot_stream_bf16<TM>(wb + (n - n0) * K, xh, xl, x, y + n, N, K);
}

inline void stream_rows_bf16(const float* x, const bf16* xh, const bf16* xl, const bf16* wb,
                             float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  switch (M) {
    case 1: return few_rows_bf16<1>(x, xh, xl, wb, y, N, K, n0, n1);
    case 2: return few_rows_bf16<2>(x, xh, xl, wb, y, N, K, n0, n1);
    case 3: return few_rows_bf16<3>(x, xh, xl, wb, y, N, K, n0, n1);
    default: return few_rows_bf16<4>(x, xh, xl, wb, y, N, K, n0, n1);
  }
}
#else
constexpr bool kDotBf16 = false;
#endif

// Rows [n0, n1) of y = x w^T, the block's weight rows starting at wb (row n0).
template <typename W>
void linear_block(const float* x, const W* wb, float* y, int64_t M, int64_t N, int64_t K,
                  int64_t n0, int64_t n1) {
  if (M == 2 && kFewM >= 2) return few_rows<2>(x, wb, y, N, K, n0, n1);
  if (M == 3 && kFewM >= 3) return few_rows<3>(x, wb, y, N, K, n0, n1);
  if (M == 4 && kFewM >= 4) return few_rows<4>(x, wb, y, N, K, n0, n1);
  if (M == 5 && kFewM >= 5) return few_rows<5>(x, wb, y, N, K, n0, n1);
  if (M == 6 && kFewM >= 6) return few_rows<6>(x, wb, y, N, K, n0, n1);
  if (M == 7 && kFewM >= 7) return few_rows<7>(x, wb, y, N, K, n0, n1);
  if (M == 8 && kFewM >= 8) return few_rows<8>(x, wb, y, N, K, n0, n1);
  if (M < kTileM || M <= 3) {
    for (int64_t m = 0; m < M; ++m) few_rows<1>(x + m * K, wb, y + m * N, N, K, n0, n1);
    return;
  }
  int64_t n = n0;
  for (; n + kTileN <= n1; n += kTileN) {
    const W* wr = wb + (n - n0) * K;
    // the tile after next's rows, fetched during the first pass over these: the hardware
    // prefetchers alone left the tiles waiting on kTileN interleaved row streams (old and
    // new builds alternated call by call: 2,566 x 768 at 4 / 8 rows 0.64 / 0.75 -> 0.49 /
    // 0.64 ms, the lm_head at 8 rows 26.4 -> 22.3, 64 experts top-8 at 64 tokens 8.2 -> 7.2;
    // bf16 weights alike)
    const W* pf = n + 3 * kTileN <= n1 ? wr + 2 * kTileN * K : nullptr;
    int64_t m = 0;
    for (; m + kTileM <= M; m += kTileM, pf = nullptr)
      dot_tile<kTileN, kTileM, false>(wr, x + m * K, y + m * N + n, N, K, pf);
    for (; m < M; ++m) dot_tile<kTileN, 1, false>(wr, x + m * K, y + m * N + n, N, K);
  }
  for (; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m)
      dot_tile<1, 1, false>(wb + (n - n0) * K, x + m * K, y + m * N + n, N, K);
}

// From a vector's worth of x rows on, the product is compute-bound and the dot tiles above
// (a horizontal sum per output, one x row per tile on AVX2) reach ~45-90 GFLOP/s. Here x is
// transposed once per call (x^T [K, Mp], zero-padded to whole vectors) and each output tile
// holds kBN weight rows x kBV vectors of x rows: a weight element is broadcast and multiplied
// into kBV vectors of x rows, with no horizontal sums. The kBN weight rows being read (kBN x K)
// stay in L1 while every vector of x rows passes over them, so each weight is read from memory
// once per call (AVX2 AMD EPYC, 2 threads, GFLOP/s dot tiles / broadcast, 16 / 48 / 128 rows:
// 900 x 256 45 / 87, 46 / 76, 45 / 75; 4096 x 256 64 / 137, 60 / 126, 59 / 103; 2816 x 768
// 59 / 120, 73 / 105, 89 / 125; at 4 rows, half the lanes padding, 40-69 / 31-39).
#if defined(__AVX512F__)
constexpr int kBN = 8, kBV = 3;  // 24 accumulators + 3 x vectors + a broadcast of 32 registers
#else
constexpr int kBN = 6, kBV = 2;  // 12 + 2 + 1 of 16
#endif

// The k range is walked in chunks of kKc so that the x^T strip a tile reads (kKc x kBV
// vectors, 16 KB) stays in L1 beside the panel's weights; without the chunks a 768-wide
// input fell from ~140 to ~70 GFLOP/s above 32 rows.
constexpr int64_t kKc = 4096 / (kBV * kLanes);

// x^T may be stored in column blocks of kXB x rows, each block [K, its width] on its own (the
// last one narrower), rather than as one [K, Mp] array: a strip's k rows then lie next to each
// other. In one array they are Mp floats apart, and from 64 rows on that stride maps a strip's
// 256 cache lines onto a fraction of L1's sets, so it no longer stays there (one thread, a 6 x
// 768 panel against x^T in L2: 64 / 256 rows 76 / 51 GFLOP/s in one array, 83 / 76 in
// blocks). `xw`, where a function takes it, is the block width: kXB, or Mp for one array.
constexpr int64_t kXB = kBV * kLanes;

#if defined(__AVX2__) && !defined(__AVX512F__)
// 8 x 8 floats transposed in registers: afterwards r[j] holds lane j of each input r[i].
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {  // t[i] = a0 b0 a1 b1 | a4 b4 a5 b5 of rows i, i + 1
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // u[i + j] = lanes j and j + 4 of rows i..i+3
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x20);
    r[j + 4] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x31);
  }
}
#endif

// Where x^T element (k, m) is: blocks of xw columns.
inline int64_t xt_index(int64_t k, int64_t m, int64_t K, int64_t Mp, int64_t xw) {
  const int64_t b0 = m / xw * xw;
  return b0 * K + k * std::min(xw, Mp - b0) + (m - b0);
}

// Rows [k0, k1) of x^T [K, Mp] (in blocks of xw columns, zero-padded) from the M rows of x at
// x + row(m). On AVX2 8 x 8 blocks transposed in registers: an element at a time (a strided
// load and a store each) was a third of the time the hidden-256 MoE's batch-16 int8
// products spent outside their tiles, and with the experts' y^T out (moe_cpu.cpp) 15% of a
// 2,048-token layer's expert time.
template <typename Row>
inline void fill_xt(const float* x, Row row, int64_t M, int64_t K, int64_t Mp, int64_t xw,
                    float* xt, int64_t k0, int64_t k1) {
  int64_t k = k0;
#if defined(__AVX2__) && !defined(__AVX512F__)
  for (; k + 8 <= k1; k += 8)
    for (int64_t m0 = 0; m0 < Mp; m0 += 8) {  // Mp and xw: whole vectors of 8 lanes
      __m256 r[8];
      for (int j = 0; j < 8; ++j)
        r[j] = m0 + j < M ? _mm256_loadu_ps(x + row(m0 + j) + k) : _mm256_setzero_ps();
      transpose8(r);
      const int64_t width = std::min(xw, Mp - m0 / xw * xw);  // of m0's block
      float* out = xt + xt_index(k, m0, K, Mp, xw);
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(out + j * width, r[j]);
    }
#endif
  for (; k < k1; ++k)
    for (int64_t b0 = 0; b0 < Mp; b0 += xw) {
      float* out = xt + xt_index(k, b0, K, Mp, xw);
      for (int64_t m = b0; m < std::min(Mp, b0 + xw); ++m)
        out[m - b0] = m < M ? x[row(m) + k] : 0.0f;
    }
}

// y^T[n0 + i, m] (+)= the TN weight rows at w (stride ldw) over k in [k0, k1), against x^T
// columns [m0, m0 + TV lanes), which start at xb with k rows ldx apart (in one block of x^T):
// y is given transposed (y^T, stride Mp) and the tile goes out as whole vectors, padding
// lanes too. (Row-major y took each lane on its own, which on a 768-wide input, ten k chunks
// of adds, was as many instructions again as the FMAs: an expert's 96-token block ran at
// ~100 GFLOP/s against ~150 transposed.) The first chunk (k0 == 0) stores, later ones add.
// pf (nullable): the next panel's rows, a line of each per 16 k from k0 on, fetched into
// cache while this one computes. A decode step streams more weights than the L3 holds, so each
// panel arrives from memory, and the hardware prefetchers follow its TN interleaved row
// streams only part of the way: the hidden-256 MoE's batch-16 step 7-8% faster (old and new
// builds alternated step by step in one engine; 2% at batch 64, none at 1).
template <int TN, int TV>
inline void bcast_tile(const float* __restrict w, int64_t ldw, const float* __restrict xb,
                       int64_t ldx, int64_t Mp, float* __restrict yt, int64_t k0, int64_t k1,
                       int64_t m0, int64_t n0, const float* pf = nullptr) {
  vtile acc[TN][TV] = {};
  for (int64_t kb = k0; kb < k1; kb += 16) {
    if (pf != nullptr)  // a cache line of each next-panel row per 16 k
      for (int i = 0; i < TN; ++i) __builtin_prefetch(pf + i * ldw + kb, 0, 3);
    const int64_t ke = std::min(k1, kb + 16);
#pragma GCC unroll 4
    for (int64_t k = kb; k < ke; ++k) {
      vtile xv[TV];
      for (int v = 0; v < TV; ++v) xv[v] = load_tile(xb + k * ldx + v * kLanes);
      for (int i = 0; i < TN; ++i) {
        const vtile b = splat(w[i * ldw + k]);
        for (int v = 0; v < TV; ++v) acc[i][v] += b * xv[v];
      }
    }
  }
  for (int i = 0; i < TN; ++i)
    for (int v = 0; v < TV; ++v) {
      float* out = yt + (n0 + i) * Mp + m0 + v * kLanes;
      const vtile sum = k0 == 0 ? acc[i][v] : load_tile(out) + acc[i][v];
      __builtin_memcpy(out, &sum, sizeof(sum));
    }
}

// prefetch: w is the weight itself (fp32), so the next panel follows it in memory; a bf16 or
// int8 panel comes widened in a buffer, and the next one is read by the widening anyway.
template <int TN>
void bcast_panel(const float* w, const float* xt, int64_t Mp, int64_t xw, float* yt, int64_t K,
                 int64_t n0, bool prefetch) {
  const int64_t vecs = Mp / kLanes;
  // x^T's columns from m0 on (a tile's kBV vectors never straddle two of its blocks)
  const auto strip = [&](int64_t m0) { return xt + xt_index(0, m0, K, Mp, xw); };
  const auto ld = [&](int64_t m0) { return std::min(xw, Mp - m0 / xw * xw); };
  for (int64_t k0 = 0; k0 < K; k0 += kKc) {
    const int64_t k1 = std::min(K, k0 + kKc);
    int64_t v = 0;
    for (; v + kBV <= vecs; v += kBV)
      bcast_tile<TN, kBV>(w, K, strip(v * kLanes), ld(v * kLanes), Mp, yt, k0, k1, v * kLanes,
                          n0, prefetch && v == 0 ? w + TN * K : nullptr);
    for (; v < vecs; ++v)
      bcast_tile<TN, 1>(w, K, strip(v * kLanes), ld(v * kLanes), Mp, yt, k0, k1, v * kLanes,
                        n0);
  }
}

// y^T [rows, Mp] = a weight's `rows` rows against x^T [K, Mp] (zero-padded, in blocks of xw
// columns; padding columns of y^T come out zero), panel by panel: `panel(p, tn)` gives rows
// [p, p + tn) as fp32 [tn, K] (the weight itself, or its rows widened into a buffer that stays
// in L1); `direct`: the panels are the weight in memory, so the next one can be prefetched.
template <typename Panel>
void bcast_panels(Panel panel, int64_t rows, int64_t K, const float* xt, int64_t Mp,
                  int64_t xw, float* yt, bool direct) {
  for (int64_t p = 0; p < rows; p += kBN) {
    const int64_t tn = std::min<int64_t>(kBN, rows - p);
    const float* wp = panel(p, tn);
    // A last panel of fewer rows keeps them together: a one-row tile has kBV accumulators,
    // too few chains of dependent FMAs to fill the FMA units, and on AVX2 (6-row panels) 2I
    // or D rows are seldom whole panels (a row at a time took ~10% of the experts' time: 64
    // experts top-8 at hidden 768, 7 layers cold, 64 / 2,048 tokens 6.8 / 102 -> 6.1 / 98 ms
    // a layer, the first with moe_cpu.cpp's task balance, measured together)
    switch (tn) {
      case kBN: bcast_panel<kBN>(wp, xt, Mp, xw, yt, K, p, direct); break;
      case 1: bcast_panel<1>(wp, xt, Mp, xw, yt, K, p, false); break;
      case 2: bcast_panel<2>(wp, xt, Mp, xw, yt, K, p, false); break;
      case 3: bcast_panel<3>(wp, xt, Mp, xw, yt, K, p, false); break;
      case 4: bcast_panel<4>(wp, xt, Mp, xw, yt, K, p, false); break;
      case 5: bcast_panel<5>(wp, xt, Mp, xw, yt, K, p, false); break;
#if defined(__AVX512F__)
      case 6: bcast_panel<6>(wp, xt, Mp, xw, yt, K, p, false); break;
      case 7: bcast_panel<7>(wp, xt, Mp, xw, yt, K, p, false); break;
#endif
      default:  // a kBN past these cases: a row at a time
        for (int64_t i = 0; i < tn; ++i)
          bcast_panel<1>(wp + i * K, xt, Mp, xw, yt, K, p + i, false);
    }
  }
}

// bcast_panels over the rows at w (stride K). bf16 / int8 weights: each panel is widened into
// `wide` (kBN x K floats) and the fp32 tiles run on it; widening each broadcast element on its
// own (a scalar load, shift or convert and broadcast per FMA group) ran bf16 at ~50 GFLOP/s
// where fp32 reached 75-160.
template <typename W>
void bcast_rows(const W* w, int64_t rows, int64_t K, const float* xt, int64_t Mp, int64_t xw,
                float* yt, float* wide) {
  constexpr bool fp32 = std::is_same_v<W, float>;
  const auto panel = [&](int64_t p, int64_t tn) -> const float* {
    if constexpr (fp32) {
      return w + p * K;
    } else {
      const W* src = w + p * K;
      int64_t j = 0;
      for (; j + kLanes <= tn * K; j += kLanes) {
        const vtile v = load_tile(src + j);
        __builtin_memcpy(wide + j, &v, sizeof(v));
      }
      for (; j < tn * K; ++j) wide[j] = widen(src[j]);
      return wide;
    }
  };
  bcast_panels(panel, rows, K, xt, Mp, xw, yt, fp32);
}

constexpr int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// Up to this many tokens an expert's weight rows are streamed one at a time, each dotted with
// every token (dot_stream: one sequential read, which the prefetchers follow): the 8-row dot
// tiles read from memory ran a 16-token layer (8 experts top-2, ~4 tokens each, weights cold)
// at 430 us against 351 this way, the same when the weights sit in cache.
constexpr int64_t kStreamM = 4;
template <int R, int TM, typename W>
void row_tiles(const float* x, const W* wb, float* y, int64_t N, int64_t K, int64_t n0,
               int64_t n1) {
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    const W* w = wb + (n - n0) * K;
    dot_tile<R, TM, false>(w, x, y + n, N, K, w + R * K);  // prefetching the next R rows
  }
  for (; n < n1; ++n) dot_stream<TM>(wb + (n - n0) * K, x, y + n, N, K);
}

// int8 weights at 2-4 x rows go R rows at a time (dot_tile), which loads each x vector once
// for R weight rows instead of once per row: one row at a time, the x loads (one per FMA)
// bound a widened int8 stream in cache. 8 experts top-2 at hidden 256, 16 tokens, 7 layers
// cycled (in the L3): 333 -> 292 us a layer; 64 experts top-8 at hidden 768, 4 / 16 tokens
// (from memory) 855 / 1,912 -> 834 / 1,855. fp32 and bf16 stay one row at a time: from
// memory, fp32 ran 16-37% slower in row tiles, bf16 3% slower.
template <typename W>
void stream_rows(const float* x, const W* wb, float* y, int64_t M, int64_t N, int64_t K,
                 int64_t n0, int64_t n1) {
  if constexpr (std::is_same_v<W, int8_t>) {
    switch (M) {
      case 1: return few_rows<1>(x, wb, y, N, K, n0, n1);
      case 2: return row_tiles<4, 2>(x, wb, y, N, K, n0, n1);
      case 3: return row_tiles<3, 3>(x, wb, y, N, K, n0, n1);
      default: return row_tiles<2, 4>(x, wb, y, N, K, n0, n1);
    }
  }
  switch (M) {
    case 1: return few_rows<1>(x, wb, y, N, K, n0, n1);
    case 2: return few_rows<2>(x, wb, y, N, K, n0, n1);
    case 3: return few_rows<3>(x, wb, y, N, K, n0, n1);
    default: return few_rows<4>(x, wb, y, N, K, n0, n1);
  }
}
