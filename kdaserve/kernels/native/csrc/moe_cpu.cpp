// Routed experts on the CPU: the router's top-k (DeepSeek-V3 noaux_tc) and the experts'
// gated products for decode-sized and prefill-sized batches; fp32 activations against
// fp32, bf16 or int8 weights. Built into the same library as kda_cpu.cpp (build.py) and
// tested against the plain-torch references in kdaserve/kernels/ref.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <memory>
#include <omp.h>
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

inline float sigmoidf(float x) { return 1.0f / (1.0f + std::exp(-x)); }

#include "tiles.h"
#include "vmath.h"
#include "expert_order.h"
#include "gemm_blocks.h"
#include "expert_blocks.h"

// Tokens [s0, s1) of expert e (sorted order; order[s] / k is the token) into ys rows s0..s1,
// weighted by their routing weights. Transposed all the way through: the broadcast tiles
// store whole vectors of tokens, and the SiLU gate runs on rows of h^T into a^T directly.
template <typename W>
void expert_block(const float* x, const int64_t* order, const float* weights, const W* w13,
                  const W* w2, const float* s13, const float* s2, float* ys, int64_t e,
                  int64_t s0, int64_t s1, int64_t k, int64_t I, int64_t D, BlockScratch& b,
                  const Glu& act) {
  const int64_t M = s1 - s0, Mp = round_up(M, kLanes);
  float *xt = b.xt.get(), *ht = b.ht.get(), *at = b.at.get(), *yt = b.yt.get();
  if constexpr (std::is_same_v<W, bf16> || std::is_same_v<W, int8_t>) {
    // bf16 (and int8, as exact bf16 panels) weights on AMX tiles where the host has them;
    // int8 row scales applied to h and y as they come out
    if (linear_amx_ready() == 1) {
      amx_block(x, order, weights, ys, s0, s1, k, I, D, b, act,
                [&](const float* xr, float* hr) {
                  if constexpr (std::is_same_v<W, bf16>)
                    linear_amx_bf16w(xr, w13 + e * 2 * I * D, hr, M, 2 * I, D, 0);
                  else
                    linear_amx_int8w(xr, w13 + e * 2 * I * D, s13 + e * 2 * I, hr, M, 2 * I,
                                     D, 0);
                },
                [&](const float* ar, float* yr) {
                  if constexpr (std::is_same_v<W, bf16>)
                    linear_amx_bf16w(ar, w2 + e * D * I, yr, M, D, I, 0);
                  else
                    linear_amx_int8w(ar, w2 + e * D * I, s2 + e * D, yr, M, D, I, 0);
                });
      return;
    }
  }
  int32_t row[kBlockRows];  // the block's tokens' x rows, as offsets from x (int32: see below)
  for (int64_t m = 0; m < M; ++m) row[m] = static_cast<int32_t>((order[s0 + m] / k) * D);
  gather_t(x, row, M, Mp, D, xt);
  bcast_rows(w13 + e * 2 * I * D, 2 * I, D, xt, Mp, Mp, ht, b.wide.get());
  if (s13 != nullptr)
    for (int64_t r = 0; r < 2 * I; ++r)
      for (int64_t m = 0; m < Mp; ++m) ht[r * Mp + m] *= s13[e * 2 * I + r];
  glu_row(act, ht, ht + I * Mp, at, I * Mp);  // zero padding stays zero: act(0) * 0
  bcast_rows(w2 + e * D * I, D, I, at, Mp, Mp, yt, b.wide.get());
  float wt[kBlockRows];  // the block's tokens' routing weights
  for (int64_t m = 0; m < M; ++m) wt[m] = weights[order[s0 + m]];
  scatter_t(yt, M, Mp, D, s2 != nullptr ? s2 + e * D : nullptr, wt, ys + s0 * D);
}

// Routed experts: E_e(x) = W2 (SiLU(W1 x) * W3 x), weighted and summed over each token's k
// choices.  x [T, D]; ids, weights [T, k]; w13 [E, 2I, D] (gate rows then up rows); w2
// [E, D, I]; out [T, D].  Choices are grouped by expert (a counting sort). An expert with
// `blocked_from` tokens or more runs as token blocks (expert_block); one with fewer has its
// tokens' x rows gathered and is one small product per projection (the tiles of
// gemm_blocks.h: each weight row read once for all its tokens), work split over (expert,
// block of weight rows). The broadcast tiles were tried that way, split over weight rows,
// for experts with 8+ tokens and did not pay: 8 experts top-2 at hidden 256, 48 tokens 0.74
// ms against 0.79 (1.03 with the broadcast tiles' tasks on a dynamic schedule; the
// small experts' own tasks below are dynamic), 64 experts top-8 at hidden 768 equal
// within 5%; whole-expert token blocks are what pays for prefill.
// s13 [E, 2I] and s2 [E, D] (nullable): int8 weights' per-row scales.
template <typename W>
void moe_experts(const float* x, const int64_t* ids, const float* weights, const W* w13,
                 const W* w2, const float* s13, const float* s2, float* out, int64_t T,
                 int64_t k, int64_t E, int64_t I, int64_t D, int64_t blocked_from,
                 const Glu& glu) {
  const int64_t n = T * k;
  if (T * D > INT32_MAX) blocked_from = INT64_MAX;  // gather_t's int32 row offsets
  const ExpertOrder sorted(ids, n, E);
  const std::vector<int64_t>&offset = sorted.offset, &order = sorted.order;
  const ExpertPlan plan(offset, E, blocked_from);
  const std::vector<int64_t>& small = plan.small;  // experts split over weight rows
  const int64_t A = static_cast<int64_t>(small.size());
  // rows in sorted order (an expert's tokens are consecutive); xs, h and act are only read
  // for the small experts' rows. Left uninitialised: a prefill's 50 MB would be zeroed.
  std::unique_ptr<float[]> ys(new float[n * D]);
  const int64_t small_rows = A > 0 ? n : 0;
  std::unique_ptr<float[]> xs(new float[small_rows * D]), h(new float[small_rows * 2 * I]),
      act(new float[small_rows * I]);
  // bf16 weights at 1-4 tokens take the BF16 dots (gemm_blocks.h): xs and act split as well
  constexpr bool kSplit = kDotBf16 && std::is_same_v<W, bf16>;
  static_assert(!kSplit || kDotBf16Rows == kStreamM, "split rows are the streamed rows");
  std::unique_ptr<bf16[]> xsplit(new bf16[kSplit ? 2 * small_rows * D : 0]),
      asplit(new bf16[kSplit ? 2 * small_rows * I : 0]);
  constexpr int64_t kRows = 32;
  const int64_t iblocks = (I + kRows - 1) / kRows, dblocks = (D + kRows - 1) / kRows;
  // The small experts' x rows are gathered before the team starts (32 KB at batch 16,
  // hidden 256; threaded only where many rows are small, e.g. every expert when T * D rules
  // out blocks), and their tasks are taken as threads free up: a thread busy with a token
  // block no longer holds the other at the gather's barrier or to a fixed half of the tasks
  // (8 experts top-2 at hidden 256, 7 layers cold, 16 / 48 tokens 0.43 / 0.63 -> 0.39 / 0.58
  // ms a layer; bf16 0.27 -> 0.24; 64 experts top-8 at hidden 768 equal).
#pragma omp parallel for schedule(static) if (small_rows * D >= (int64_t{1} << 20))
  for (int64_t a = 0; a < A; ++a)
    for (int64_t s = offset[small[a]]; s < offset[small[a] + 1]; ++s) {
      std::copy(x + (order[s] / k) * D, x + (order[s] / k + 1) * D, xs.get() + s * D);
#if defined(KDASERVE_BF16_DOTS)
      if constexpr (kSplit)
        if (offset[small[a] + 1] - offset[small[a]] <= kDotBf16Rows)
          split_bf16(xs.get() + s * D, D, xsplit.get() + s * D,
                     xsplit.get() + (small_rows + s) * D);
#endif
    }
  // Weight rows [r0, r1) of small expert e's gate and up projections, for all its tokens, and
  // their activations; then output rows [d0, d1) of its down projection, weighted
  const auto gate_up = [&](int64_t e, int64_t r0, int64_t r1) {
    const int64_t s0 = offset[e], cnt = offset[e + 1] - s0;
    const W* we = w13 + e * 2 * I * D;
    float* he = h.get() + s0 * 2 * I;
    const float* xe = xs.get() + s0 * D;
    if (cnt <= kStreamM) {
      // bandwidth-bound: gate and up rows read side by side, two streams in flight
      // (measured 10% faster than one block after the other at 1-4 tokens, fp32); int8
      // rows in runs of 24, which stream_rows takes a few rows at a time
      constexpr int64_t kSide = std::is_same_v<W, int8_t> ? 24 : 1;
      for (int64_t r = r0; r < r1; r += kSide) {
        const int64_t re = std::min(r1, r + kSide);
#if defined(KDASERVE_BF16_DOTS)
        if constexpr (kSplit) {
          const bf16 *xh = xsplit.get() + s0 * D, *xl = xsplit.get() + (small_rows + s0) * D;
          stream_rows_bf16(xe, xh, xl, we + r * D, he, cnt, 2 * I, D, r, re);
          stream_rows_bf16(xe, xh, xl, we + (I + r) * D, he, cnt, 2 * I, D, I + r, I + re);
          continue;
        }
#endif
        stream_rows(xe, we + r * D, he, cnt, 2 * I, D, r, re);
        stream_rows(xe, we + (I + r) * D, he, cnt, 2 * I, D, I + r, I + re);
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
      float* am = act.get() + (s0 + m) * I;
      glu_row(glu, g + r0, g + I + r0, am + r0, r1 - r0);
#if defined(KDASERVE_BF16_DOTS)
      if constexpr (kSplit)
        if (cnt <= kDotBf16Rows)  // this task's columns of the down projection's x
          split_bf16(am + r0, r1 - r0, asplit.get() + (s0 + m) * I + r0,
                     asplit.get() + (small_rows + s0 + m) * I + r0);
#endif
    }
  };
  const auto down = [&](int64_t e, int64_t d0, int64_t d1) {
    const int64_t s0 = offset[e], cnt = offset[e + 1] - s0;
    bool done = false;
#if defined(KDASERVE_BF16_DOTS)
    if constexpr (kSplit)
      if (cnt <= kDotBf16Rows) {
        stream_rows_bf16(act.get() + s0 * I, asplit.get() + s0 * I,
                         asplit.get() + (small_rows + s0) * I, w2 + (e * D + d0) * I,
                         ys.get() + s0 * D, cnt, D, I, d0, d1);
        done = true;
      }
#endif
    if (done) {
    } else if (cnt <= kStreamM) {
      stream_rows(act.get() + s0 * I, w2 + (e * D + d0) * I, ys.get() + s0 * D, cnt, D, I,
                  d0, d1);
    } else {
      linear_block(act.get() + s0 * I, w2 + (e * D + d0) * I, ys.get() + s0 * D, cnt, D,
                   I, d0, d1);
    }
    for (int64_t m = 0; m < cnt; ++m) {
      const float wt = weights[order[s0 + m]];
      for (int64_t d = d0; d < d1; ++d)
        ys[(s0 + m) * D + d] *= (s2 != nullptr ? s2[e * D + d] : 1.0f) * wt;
    }
  };
  // With two or more small experts a thread, each expert is one task (its gate/up rows, its
  // activations, its down rows): no barrier between the projections and whole-matrix streams
  // instead of 32-row pieces (the down projection's were 8 KB at I 128). 64 experts top-8 at
  // hidden 768, one token, bf16, 7 layers cold, alternated: 21 -> 27-29 GB/s, the read probe
  // 33 (2-core AMD EPYC, Zen 4). Experts above the streamed rows' kStreamM tokens are tasks
  // too (they had put the whole layer back on the pieces: a verify's 8 tokens over 96
  // experts top-16, 73 of them used, one with 5 tokens; 7 layers, fp32, alternated: 19.4-21.2
  // -> 15.9-17.8 ms; 16 tokens 26.1-26.8 -> 23.5-24.1). A value is the same sum either way.
  bool whole = A >= 2 * omp_get_max_threads();
#pragma omp parallel
  {
    run_blocks(plan, I, D, [&](const std::array<int64_t, 3>& b, BlockScratch& scratch) {
      expert_block(x, order.data(), weights, w13, w2, s13, s2, ys.get(), b[0], b[1], b[2], k,
                   I, D, scratch, glu);
    });
    if (A > 0 && whole) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t a = 0; a < A; ++a) {
        gate_up(small[a], 0, I);
        down(small[a], 0, D);
      }
    } else if (A > 0) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < A * iblocks; ++task)
        gate_up(small[task / iblocks], (task % iblocks) * kRows,
                std::min(I, (task % iblocks + 1) * kRows));
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < A * dblocks; ++task)
        down(small[task / dblocks], (task % dblocks) * kRows,
             std::min(D, (task % dblocks + 1) * kRows));
    }
#pragma omp barrier
    sum_choices(ys.get(), sorted.slot.data(), out, T, k, D);
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

// blocked_from: the tokens from which an expert runs as token blocks (moe_experts);
// beta, linear_beta: the experts' activation (Glu: beta 0 is SwiGLU, else K3's SiTU)
void moe_experts_f32(const float* x, const int64_t* ids, const float* weights, const float* w13,
                     const float* w2, float* out, int64_t T, int64_t k, int64_t E, int64_t I,
                     int64_t D, int64_t blocked_from, float beta, float linear_beta) {
  moe_experts(x, ids, weights, w13, w2, nullptr, nullptr, out, T, k, E, I, D, blocked_from,
              Glu{beta, linear_beta});
}

void moe_experts_bf16w(const float* x, const int64_t* ids, const float* weights,
                       const bf16* w13, const bf16* w2, float* out, int64_t T, int64_t k,
                       int64_t E, int64_t I, int64_t D, int64_t blocked_from, float beta,
                       float linear_beta) {
  moe_experts(x, ids, weights, w13, w2, nullptr, nullptr, out, T, k, E, I, D, blocked_from,
              Glu{beta, linear_beta});
}

void moe_experts_int8w(const float* x, const int64_t* ids, const float* weights,
                       const int8_t* w13, const int8_t* w2, const float* s13, const float* s2,
                       float* out, int64_t T, int64_t k, int64_t E, int64_t I, int64_t D,
                       int64_t blocked_from, float beta, float linear_beta) {
  moe_experts(x, ids, weights, w13, w2, s13, s2, out, T, k, E, I, D, blocked_from,
              Glu{beta, linear_beta});
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


}  // extern "C"
