// Skinny GEMMs and routed experts for decode-sized batches (a few rows), and the bandwidth
// probe; fp32 activations against fp32, bf16 or int8 weights (widened in registers, see
// tiles.h). Built into the same library as kda_cpu.cpp (build.py) and tested against the
// plain-torch references in kdaserve/kernels/ref.

#include <algorithm>
#include <cmath>
#include <cstdint>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <memory>
#include <type_traits>
#include <vector>

namespace {

inline float sigmoidf(float x) { return 1.0f / (1.0f + std::exp(-x)); }

#include "tiles.h"
#include "vmath.h"

// y [M, N] = x [M, K] @ w [N, K]^T for a few rows (decode). MKL's sgemm packs w on every
// call, which on these shapes reaches about a third of the memory bandwidth (measured on the
// 100k x 768 lm_head: 11.7 GB/s against 30+ here). Here each block of weight rows is streamed
// once per call and dotted with the x rows in register tiles while it sits in L2.
//
// Up to kFewM x rows the product is bandwidth-bound: the weight rows are read one after the
// other (one sequential stream, which the prefetchers follow best), each dotted with every x
// row in kUnroll independent partial sums (a single running sum per dot stalls on the add
// latency: bf16 weights streamed at ~37 GB/s, int8 at ~30, on a host reading 70+). More x
// rows make it compute-bound: kTileN x kTileM tiles.
#if defined(__AVX512F__)
constexpr int kFewM = 3;
#else
constexpr int kFewM = 1;  // 16 registers
#endif
constexpr int kUnroll = 2;

template <int TM, typename W>
inline void dot_stream(const W* __restrict w, const float* __restrict x, float* __restrict y,
                       int64_t N, int64_t K) {
  vtile acc[kUnroll][TM] = {};
  int64_t j = 0;
  for (; j + kUnroll * kLanes <= K; j += kUnroll * kLanes)
    for (int u = 0; u < kUnroll; ++u) {
      const vtile wv = load_tile(w + j + u * kLanes);
      for (int tm = 0; tm < TM; ++tm) acc[u][tm] += wv * load_tile(x + tm * K + j + u * kLanes);
    }
  for (; j + kLanes <= K; j += kLanes) {
    const vtile wv = load_tile(w + j);
    for (int tm = 0; tm < TM; ++tm) acc[0][tm] += wv * load_tile(x + tm * K + j);
  }
  for (int tm = 0; tm < TM; ++tm) {
    vtile a = acc[0][tm];
    for (int u = 1; u < kUnroll; ++u) a += acc[u][tm];
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

// Rows [n0, n1) of y = x w^T, the block's weight rows starting at wb (row n0).
template <typename W>
void linear_block(const float* x, const W* wb, float* y, int64_t M, int64_t N, int64_t K,
                  int64_t n0, int64_t n1) {
  if (M == 2 && kFewM >= 2) return few_rows<2>(x, wb, y, N, K, n0, n1);
  if (M == 3 && kFewM >= 3) return few_rows<3>(x, wb, y, N, K, n0, n1);
  if (M < kTileM || M <= 3) {
    for (int64_t m = 0; m < M; ++m) few_rows<1>(x + m * K, wb, y + m * N, N, K, n0, n1);
    return;
  }
  int64_t n = n0;
  for (; n + kTileN <= n1; n += kTileN) {
    const W* wr = wb + (n - n0) * K;
    int64_t m = 0;
    for (; m + kTileM <= M; m += kTileM)
      dot_tile<kTileN, kTileM, false>(wr, x + m * K, y + m * N + n, N, K);
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

// y[m, n0 + i] (+)= the TN weight rows at w (stride ldw) over k in [k0, k1), against x^T
// columns [m0, m0 + TV lanes); padding rows (m >= M) are computed but not stored. The first
// chunk (k0 == 0) stores, later ones add. pf (nullable): the next panel's rows, fetched into
// cache while this one computes. A decode step streams more weights than the L3 holds, so
// each panel arrives from memory, and the hardware prefetchers follow its TN interleaved
// row streams only part of the way: the hidden-256 MoE's batch-16 step 7-8% faster (old
// and new builds alternated step by step in one engine; 2% at batch 64, none at 1).
template <int TN, int TV>
inline void bcast_tile(const float* __restrict w, int64_t ldw, const float* __restrict xt,
                       int64_t Mp, float* __restrict y, int64_t M, int64_t N, int64_t k0,
                       int64_t k1, int64_t m0, int64_t n0, const float* pf = nullptr) {
  vtile acc[TN][TV] = {};
  for (int64_t k = k0; k < k1; ++k) {
    if (pf != nullptr && (k & 15) == 0)  // a cache line of each next-panel row per 16 k
      for (int i = 0; i < TN; ++i) __builtin_prefetch(pf + i * ldw + k, 0, 3);
    vtile xv[TV];
    for (int v = 0; v < TV; ++v) xv[v] = load_tile(xt + k * Mp + m0 + v * kLanes);
    for (int i = 0; i < TN; ++i) {
      const vtile b = splat(w[i * ldw + k]);
      for (int v = 0; v < TV; ++v) acc[i][v] += b * xv[v];
    }
  }
  for (int v = 0; v < TV; ++v)
    for (int l = 0; l < kLanes && m0 + v * kLanes + l < M; ++l)
      for (int i = 0; i < TN; ++i) {
        float* out = y + (m0 + v * kLanes + l) * N + n0 + i;
        *out = k0 == 0 ? acc[i][v][l] : *out + acc[i][v][l];
      }
}

// prefetch: w is the weight itself (fp32), so the next panel follows it in memory; a bf16 or
// int8 panel comes widened in a buffer, and the next one is read by the widening anyway.
template <int TN>
void bcast_panel(const float* w, const float* xt, int64_t Mp, float* y, int64_t M, int64_t N,
                 int64_t K, int64_t n0, bool prefetch) {
  const int64_t vecs = Mp / kLanes;
  for (int64_t k0 = 0; k0 < K; k0 += kKc) {
    const int64_t k1 = std::min(K, k0 + kKc);
    int64_t v = 0;
    for (; v + kBV <= vecs; v += kBV)
      bcast_tile<TN, kBV>(w, K, xt, Mp, y, M, N, k0, k1, v * kLanes, n0,
                          prefetch && v == 0 ? w + TN * K : nullptr);
    for (; v < vecs; ++v) bcast_tile<TN, 1>(w, K, xt, Mp, y, M, N, k0, k1, v * kLanes, n0);
  }
}

// y[m, n0 + i] = x[m] . w[i] for the `rows` weight rows at w (stride K), x given as x^T
// (stride Mp, zero-padded). bf16 / int8 weights: each panel of weight rows is widened into
// `wide` (kBN x K floats, it stays in L1) and the fp32 tiles run on it; widening each
// broadcast element on its own (a scalar load, shift or convert and broadcast per FMA group)
// ran bf16 at ~50 GFLOP/s where fp32 reached 75-160.
template <typename W>
void bcast_rows(const W* w, int64_t rows, int64_t K, const float* xt, int64_t Mp, float* y,
                int64_t M, int64_t N, int64_t n0, float* wide) {
  for (int64_t p = 0; p < rows; p += kBN) {
    const int64_t tn = std::min<int64_t>(kBN, rows - p);
    const float* wp;
    if constexpr (std::is_same_v<W, float>) {
      wp = w + p * K;
    } else {
      const W* src = w + p * K;
      int64_t j = 0;
      for (; j + kLanes <= tn * K; j += kLanes) {
        const vtile v = load_tile(src + j);
        __builtin_memcpy(wide + j, &v, sizeof(v));
      }
      for (; j < tn * K; ++j) wide[j] = widen(src[j]);
      wp = wide;
    }
    constexpr bool fp32 = std::is_same_v<W, float>;
    if (tn == kBN) {
      bcast_panel<kBN>(wp, xt, Mp, y, M, N, K, n0 + p, fp32);
    } else {
      for (int64_t i = 0; i < tn; ++i)
        bcast_panel<1>(wp + i * K, xt, Mp, y, M, N, K, n0 + p + i, false);
    }
  }
}

constexpr int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// scale (nullable) [N]: int8 weights' per-row scales, applied to each panel's columns as
// soon as they are final.
template <typename W>
void linear_bcast(const float* x, const W* w, const float* scale, float* y, int64_t M,
                  int64_t N, int64_t K) {
  const int64_t Mp = round_up(M, kLanes);
  std::unique_ptr<float[]> xt(new float[K * Mp]);  // every element written below
  const int64_t panels = (N + kBN - 1) / kBN;
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t k = 0; k < K; ++k) {
      float* row = xt.get() + k * Mp;
      for (int64_t m = 0; m < M; ++m) row[m] = x[m * K + k];
      for (int64_t m = M; m < Mp; ++m) row[m] = 0.0f;
    }
    std::vector<float> wide(std::is_same_v<W, float> ? 0 : kBN * K);
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t n0 = p * kBN, rows = std::min<int64_t>(kBN, N - n0);
      bcast_rows(w + n0 * K, rows, K, xt.get(), Mp, y, M, N, n0, wide.data());
      if (scale != nullptr)
        for (int64_t m = 0; m < M; ++m)
          for (int64_t n = n0; n < n0 + rows; ++n) y[m * N + n] *= scale[n];
    }
  }
}

// scale (nullable) [N]: multiplies output column n (int8 weights' per-row scales).
template <typename W>
void linear_small(const float* x, const W* w, const float* scale, float* y, int64_t M,
                  int64_t N, int64_t K) {
  if (M >= kLanes) return linear_bcast(x, w, scale, y, M, N, K);
  constexpr int64_t kRows = 64;
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


// Up to this many tokens an expert's weight rows are streamed one at a time, each dotted with
// every token (dot_stream: one sequential read, which the prefetchers follow): the 8-row dot
// tiles read from memory ran a 16-token layer (8 experts top-2, ~4 tokens each, weights cold)
// at 430 us against 351 this way, the same when the weights sit in cache.
constexpr int64_t kStreamM = 4;
template <typename W>
void stream_rows(const float* x, const W* wb, float* y, int64_t M, int64_t N, int64_t K,
                 int64_t n0, int64_t n1) {
  switch (M) {
    case 1: return few_rows<1>(x, wb, y, N, K, n0, n1);
    case 2: return few_rows<2>(x, wb, y, N, K, n0, n1);
    case 3: return few_rows<3>(x, wb, y, N, K, n0, n1);
    default: return few_rows<4>(x, wb, y, N, K, n0, n1);
  }
}

// Routed experts for a few tokens (decode): E_e(x) = W2 (SiLU(W1 x) * W3 x), weighted and
// summed over each token's k choices.  x [T, D]; ids, weights [T, k]; w13 [E, 2I, D] (gate
// rows then up rows); w2 [E, D, I]; out [T, D].  Choices are grouped by expert (a counting
// sort) and their x rows gathered, so each expert is one small product per projection (the
// register tiles above: each weight row read once for all tokens that chose its expert); work
// is split over (expert, block of rows), which keeps both cores busy even for one token.
// The broadcast tiles were tried for experts with 8+ tokens (x rows and activations kept
// transposed) and did not pay: 8 experts top-2 at hidden 256, 48 tokens 0.74 ms here against
// 0.79 (1.03 with a dynamic schedule), 64 experts top-8 at hidden 768 equal within 5%, old
// and new builds alternated in one process; the per-expert products are too small.
// s13 [E, 2I] and s2 [E, D] (nullable): int8 weights' per-row scales.
template <typename W>
void moe_decode(const float* x, const int64_t* ids, const float* weights, const W* w13,
                const W* w2, const float* s13, const float* s2, float* out, int64_t T, int64_t k,
                int64_t E, int64_t I, int64_t D) {
  const int64_t n = T * k;
  std::vector<int64_t> offset(E + 1, 0), order(n), slot(n);
  for (int64_t c = 0; c < n; ++c) ++offset[ids[c] + 1];
  for (int64_t e = 0; e < E; ++e) offset[e + 1] += offset[e];
  {
    std::vector<int64_t> fill(offset.begin(), offset.end() - 1);
    for (int64_t c = 0; c < n; ++c) {
      slot[c] = fill[ids[c]]++;
      order[slot[c]] = c;  // sorted position -> choice
    }
  }
  std::vector<int64_t> active;
  for (int64_t e = 0; e < E; ++e)
    if (offset[e + 1] > offset[e]) active.push_back(e);
  const int64_t A = static_cast<int64_t>(active.size());
  // xs, h, act, ys: rows in sorted order (an expert's tokens are consecutive)
  std::vector<float> xs(n * D), h(n * 2 * I), act(n * I), ys(n * D);
  constexpr int64_t kRows = 32;
  const int64_t iblocks = (I + kRows - 1) / kRows, dblocks = (D + kRows - 1) / kRows;
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t s = 0; s < n; ++s)
      std::copy(x + (order[s] / k) * D, x + (order[s] / k + 1) * D, xs.data() + s * D);
#pragma omp for schedule(static)
    for (int64_t task = 0; task < A * iblocks; ++task) {
      const int64_t e = active[task / iblocks], r0 = (task % iblocks) * kRows;
      const int64_t r1 = std::min(I, r0 + kRows), s0 = offset[e], cnt = offset[e + 1] - s0;
      const W* we = w13 + e * 2 * I * D;
      float* he = h.data() + s0 * 2 * I;
      const float* xe = xs.data() + s0 * D;
      if (cnt <= kStreamM) {
        // bandwidth-bound: gate and up rows read side by side, two streams in flight
        // (measured 10% faster than one block after the other at 1-4 tokens, fp32)
        for (int64_t r = r0; r < r1; ++r) {
          stream_rows(xe, we + r * D, he, cnt, 2 * I, D, r, r + 1);
          stream_rows(xe, we + (I + r) * D, he, cnt, 2 * I, D, I + r, I + r + 1);
        }
      } else {
        linear_block(xe, we + r0 * D, he, cnt, 2 * I, D, r0, r1);
        linear_block(xe, we + (I + r0) * D, he, cnt, 2 * I, D, I + r0, I + r1);
      }
      for (int64_t m = 0; m < cnt; ++m) {
        float* g = he + m * 2 * I;
        if (s13 != nullptr)
          for (int64_t r = r0; r < r1; ++r) {
            g[r] *= s13[e * 2 * I + r];
            g[I + r] *= s13[e * 2 * I + I + r];
          }
        // vectorised: libm's scalar expf per activation was ~10% of a 16-token MoE layer
        silu_mul_row(g + r0, g + I + r0, act.data() + (s0 + m) * I + r0, r1 - r0);
      }
    }
#pragma omp for schedule(static)
    for (int64_t task = 0; task < A * dblocks; ++task) {
      const int64_t e = active[task / dblocks], d0 = (task % dblocks) * kRows;
      const int64_t d1 = std::min(D, d0 + kRows), s0 = offset[e], cnt = offset[e + 1] - s0;
      if (cnt <= kStreamM)
        stream_rows(act.data() + s0 * I, w2 + (e * D + d0) * I, ys.data() + s0 * D, cnt, D, I,
                    d0, d1);
      else
        linear_block(act.data() + s0 * I, w2 + (e * D + d0) * I, ys.data() + s0 * D, cnt, D, I,
                     d0, d1);
      for (int64_t m = 0; m < cnt; ++m) {
        const float wt = weights[order[s0 + m]];
        for (int64_t d = d0; d < d1; ++d)
          ys[(s0 + m) * D + d] *= (s2 != nullptr ? s2[e * D + d] : 1.0f) * wt;
      }
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      float* __restrict o = out + t * D;
      for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
      for (int64_t j = 0; j < k; ++j) {
        const float* __restrict y = ys.data() + slot[t * k + j] * D;
        for (int64_t d = 0; d < D; ++d) o[d] += y[d];
      }
    }
  }
}

// DeepSeek-V3 "noaux_tc" routing of one token (`moe_route_ref`'s contract): scores by sigmoid
// or softmax, the correction bias added for selection only, groups ranked by the sum of their
// best two, top_k picked from the kept groups in descending order (ties to the lower index),
// weights the unbiased scores, renormalised and scaled. In torch it is ~12 small ops, ~45 us
// a call whatever the batch; here a few us.
void route_token(const float* logits, const float* bias, int64_t E, int64_t top_k,
                 int64_t groups, int64_t topk_group, bool renormalize, float scaling,
                 bool sigmoid, float* weights, int64_t* ids, float* scores, float* choice,
                 float* group_score, char* kept) {
  if (sigmoid) {
    for (int64_t e = 0; e < E; ++e) scores[e] = sigmoidf(logits[e]);
  } else {
    float m = logits[0], sum = 0.0f;
    for (int64_t e = 1; e < E; ++e) m = std::max(m, logits[e]);
    for (int64_t e = 0; e < E; ++e) sum += scores[e] = std::exp(logits[e] - m);
    for (int64_t e = 0; e < E; ++e) scores[e] /= sum;
  }
  for (int64_t e = 0; e < E; ++e) choice[e] = scores[e] + (bias != nullptr ? bias[e] : 0.0f);
  constexpr float kNone = -INFINITY;
  if (groups > 1) {
    const int64_t size = E / groups;
    for (int64_t g = 0; g < groups; ++g) {
      float a = kNone, b = kNone;  // the group's best two
      for (int64_t e = g * size; e < (g + 1) * size; ++e) {
        const float c = choice[e];
        if (c > a) {
          b = a;
          a = c;
        } else if (c > b) {
          b = c;
        }
      }
      group_score[g] = size > 1 ? a + b : a;
    }
    std::fill(kept, kept + groups, 0);
    for (int64_t j = 0; j < topk_group; ++j) {
      int64_t best = -1;
      for (int64_t g = 0; g < groups; ++g)
        if (!kept[g] && (best < 0 || group_score[g] > group_score[best])) best = g;
      kept[best] = true;
    }
    for (int64_t e = 0; e < E; ++e)
      if (!kept[e / size]) choice[e] = kNone;
  }
  float total = 0.0f;
  for (int64_t j = 0; j < top_k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e)
      if (choice[e] != kNone && (best < 0 || choice[e] > choice[best])) best = e;
    if (best < 0)  // fewer experts kept than top_k (a config error upstream): lowest unused
      for (int64_t e = 0; best < 0 && e < E; ++e)
        if (std::find(ids, ids + j, e) == ids + j) best = e;
    ids[j] = best;
    weights[j] = scores[best];
    total += scores[best];
    choice[best] = kNone;
  }
  const float norm = renormalize ? 1.0f / (total + 1e-20f) : 1.0f;
  for (int64_t j = 0; j < top_k; ++j) weights[j] = weights[j] * norm * scaling;
}


}  // namespace

extern "C" {

void moe_decode_f32(const float* x, const int64_t* ids, const float* weights, const float* w13,
                    const float* w2, float* out, int64_t T, int64_t k, int64_t E, int64_t I,
                    int64_t D) {
  moe_decode(x, ids, weights, w13, w2, nullptr, nullptr, out, T, k, E, I, D);
}

void moe_decode_bf16w(const float* x, const int64_t* ids, const float* weights, const bf16* w13,
                      const bf16* w2, float* out, int64_t T, int64_t k, int64_t E, int64_t I,
                      int64_t D) {
  moe_decode(x, ids, weights, w13, w2, nullptr, nullptr, out, T, k, E, I, D);
}

void moe_decode_int8w(const float* x, const int64_t* ids, const float* weights,
                      const int8_t* w13, const int8_t* w2, const float* s13, const float* s2,
                      float* out, int64_t T, int64_t k, int64_t E, int64_t I, int64_t D) {
  moe_decode(x, ids, weights, w13, w2, s13, s2, out, T, k, E, I, D);
}


// logits [T, E] fp32, bias [E] (nullable) -> weights [T, top_k] fp32, ids [T, top_k] int64
void moe_route_f32(const float* logits, const float* bias, float* weights, int64_t* ids,
                   int64_t T, int64_t E, int64_t top_k, int64_t groups, int64_t topk_group,
                   int64_t renormalize, int64_t sigmoid, float scaling) {
#pragma omp parallel if (T >= 64)
  {
    std::vector<float> scores(E), choice(E), group_score(groups);
    std::vector<char> kept(groups);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t)
      route_token(logits + t * E, bias, E, top_k, groups, topk_group, renormalize != 0,
                  scaling, sigmoid != 0, weights + t * top_k, ids + t * top_k, scores.data(),
                  choice.data(), group_score.data(), kept.data());
  }
}


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
// lowers it to AVX2 pairs and the loop stalls on them).
float read_f32(const float* x, int64_t n) {
  typedef float v8 __attribute__((vector_size(32)));
  float total = 0.0f;
  const int64_t blocks = n / 64;
#pragma omp parallel reduction(+ : total)
  {
    v8 acc[8] = {};
#pragma omp for schedule(static)
    for (int64_t i = 0; i < blocks; ++i)
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
