// Fused CPU kernels for decode (one new token per sequence), fp32 throughout.
//
// Built for the host by kdaserve/kernels/native/build.py (g++ -O3 -march=native -fopenmp) and
// called through ctypes with raw pointers to contiguous tensors; the plain-torch references in
// kdaserve/kernels/ref are the oracle they are tested against. The library links the same
// libgomp soname torch loaded, so both share one OpenMP thread pool.
//
// Inner loops run over the contiguous value / channel dimension with `__restrict` pointers so
// gcc vectorises them; outer work is split over (sequence, head) pairs.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <utility>
#include <memory>
#include <vector>

namespace {

#include "tiles.h"
#include "vmath.h"
#include "kda_common.h"

// One channel group of one head through the causal depthwise conv + SiLU, shifting the
// conv window in place. cs: the slot's [W-1, C] window (time-major), x: this token's [C] row,
// wt: the weight transposed [W, C], so every tap is a contiguous run over the channels and
// each loop below is a vector loop (per channel with the taps inside, the strided window and
// weight kept it scalar: 4% of a hidden-256 batch-16 step). Each channel still sums the
// current tap first, then the window's oldest to newest.
void conv_silu(const float* __restrict x, const float* __restrict wt, float* __restrict cs,
               int64_t C, int64_t W, int64_t first, int64_t n, float* __restrict y) {
  const float* cur = wt + (W - 1) * C + first;
  for (int64_t i = 0; i < n; ++i) y[i] = cur[i] * x[first + i];
  for (int64_t j = 0; j < W - 1; ++j) {
    const float* tap = wt + j * C + first;
    const float* past = cs + j * C + first;
    for (int64_t i = 0; i < n; ++i) y[i] += tap[i] * past[i];
  }
  for (int64_t j = 0; j + 1 < W - 1; ++j)
    std::memcpy(cs + j * C + first, cs + (j + 1) * C + first, n * sizeof(float));
  if (W > 1) std::memcpy(cs + (W - 2) * C + first, x + first, n * sizeof(float));
  map_lanes(y, y, n, [](auto a) { return a * vsigmoid(a); });
}

// One gated delta-rule step on a head's [K, V] fp32 state, in place, for columns [j0, j1); q
// and k already L2-normalised (q also scaled). Writes o [j0, j1); tmp is [V] scratch.
void delta_cols(float* __restrict S, const float* __restrict q, const float* __restrict k,
                const float* __restrict v, const float* __restrict decay, float beta, int64_t K,
                int64_t V, int64_t j0, int64_t j1, float* __restrict tmp, float* __restrict o) {
  // Pass 1: decay the state and predict v from it (k^T S).
  for (int64_t j = j0; j < j1; ++j) tmp[j] = 0.0f;
  for (int64_t i = 0; i < K; ++i) {
    float* __restrict row = S + i * V;
    const float d = decay[i], ki = k[i];
    for (int64_t j = j0; j < j1; ++j) {
      row[j] *= d;
      tmp[j] += ki * row[j];
    }
  }
  for (int64_t j = j0; j < j1; ++j) tmp[j] = (v[j] - tmp[j]) * beta;  // the delta
  // Pass 2 (the head's state is still in L2): rank-1 update, then read out with q.
  for (int64_t j = j0; j < j1; ++j) o[j] = 0.0f;
  for (int64_t i = 0; i < K; ++i) {
    float* __restrict row = S + i * V;
    const float ki = k[i], qi = q[i];
    for (int64_t j = j0; j < j1; ++j) {
      row[j] += ki * tmp[j];
      o[j] += qi * row[j];
    }
  }
}

// delta_cols on NB whole vectors of columns from j0, the prediction, the delta and the output
// held in registers: the loops above keep tmp and o in memory, two stores an element a pass,
// and ran store-bound (6 heads of 128 x 128 in L2, 2 threads: ~20 us a call). Each element
// takes the same operations in the same order, so the values are equal.
template <int NB>
inline void delta_vectors(float* __restrict S, const float* __restrict q,
                          const float* __restrict k, const float* __restrict v,
                          const float* __restrict decay, float beta, int64_t K, int64_t V,
                          int64_t j0, float* __restrict o) {
  vtile acc[NB] = {};
  for (int64_t i = 0; i < K; ++i) {
    float* row = S + i * V + j0;
    const vtile d = splat(decay[i]), ki = splat(k[i]);
    for (int b = 0; b < NB; ++b) {
      const vtile r = load_tile(row + b * kLanes) * d;
      __builtin_memcpy(row + b * kLanes, &r, sizeof(r));
      acc[b] += ki * r;
    }
  }
  const vtile bt = splat(beta);
  for (int b = 0; b < NB; ++b) acc[b] = (load_tile(v + j0 + b * kLanes) - acc[b]) * bt;
  vtile out[NB] = {};
  for (int64_t i = 0; i < K; ++i) {
    float* row = S + i * V + j0;
    const vtile ki = splat(k[i]), qi = splat(q[i]);
    for (int b = 0; b < NB; ++b) {
      const vtile r = load_tile(row + b * kLanes) + ki * acc[b];
      __builtin_memcpy(row + b * kLanes, &r, sizeof(r));
      out[b] += qi * r;
    }
  }
  for (int b = 0; b < NB; ++b) __builtin_memcpy(o + j0 + b * kLanes, &out[b], sizeof(vtile));
}

// One gated delta-rule step on a head's [K, V] state (delta_cols' contract over all columns):
// blocks of columns whose delta and output fit the registers (8 vectors with AVX-512's 32,
// 4 with AVX2's 16), then single vectors, then the scalar loops for the rest.
void delta_step(float* __restrict S, const float* __restrict q, const float* __restrict k,
                const float* __restrict v, const float* __restrict decay, float beta, int64_t K,
                int64_t V, float* __restrict tmp, float* __restrict o) {
  constexpr int kBlock = kLanes == 16 ? 8 : 4;
  int64_t j0 = 0;
  for (; j0 + kBlock * kLanes <= V; j0 += kBlock * kLanes)
    delta_vectors<kBlock>(S, q, k, v, decay, beta, K, V, j0, o);
  for (; j0 + kLanes <= V; j0 += kLanes) delta_vectors<1>(S, q, k, v, decay, beta, K, V, j0, o);
  if (j0 < V) delta_cols(S, q, k, v, decay, beta, K, V, j0, V, tmp, o);
}

// decay = exp(-exp(A_log) * softplus(f + dt_bias)) for one head's K channels; with a
// lower_bound < 0 (K3), exp(lower_bound * sigmoid(exp(A_log) * (f + dt_bias))), so no
// step forgets more than exp(lower_bound). lower_bound 0: Kimi Linear's gate.
void decay_gate(const float* __restrict f, const float* __restrict dt_bias, float A_log,
                int64_t K, float* __restrict decay, float lower_bound) {
  const float a = std::exp(A_log);
  for (int64_t i = 0; i < K; ++i) decay[i] = f[i] + dt_bias[i];
  if (lower_bound < 0.0f) {
    const float lb = lower_bound;
    map_lanes(decay, decay, K, [a, lb](auto u) { return vexp(lb * vsigmoid(a * u)); });
    return;
  }
  map_lanes(decay, decay, K, [a](auto u) { return vexp(-a * vsoftplus(u)); });
}

// dst = w * (o / rms(o)) * sigmoid(z) over one head's V outputs (fla's FusedRMSNormGated, the
// KDA output norm); gate: V floats of scratch. The decode step and the prefill's norm
// (gated_rmsnorm_f32) share it, so a token normalises the same either way.
void gated_norm_row(const float* o, const float* z, const float* w, int64_t V, float eps,
                    float* gate, float* dst) {
  float ms = 0.0f;
#pragma omp simd reduction(+ : ms)
  for (int64_t j = 0; j < V; ++j) ms += o[j] * o[j];
  const float r = 1.0f / std::sqrt(ms / static_cast<float>(V) + eps);
  map_lanes(z, gate, V, [](auto x) { return vsigmoid(x); });
  for (int64_t j = 0; j < V; ++j) dst[j] = w[j] * (o[j] * r) * gate[j];
}

// The per-row inputs of the prefill scan once prepared: q and k L2-normalised (q scaled),
// decay = exp(gate), beta after its sigmoid; v and out as given.
struct Prepared {
  const float* qn; const float* kn; const float* decay; const float* bt; const float* v;
  float* out;
  int64_t H, K, V;
  int64_t v_stride;  // between tokens' v rows (v may be a column slice of the conv output)
};

template <typename Vec> inline Vec vload(const float* p) {
  Vec x;
  __builtin_memcpy(&x, p, sizeof(x));
  return x;
}
template <typename Vec> inline void vstore(float* p, Vec x) { __builtin_memcpy(p, &x, sizeof(x)); }

// a * b + c as one fused multiply-add (b broadcast), so the scan's rounding is fixed by the
// source: left to the compiler's contraction, the sweeps with and without snapshot stores
// (an intrinsic in the loop) were contracted differently on an AVX2 host, and a snapshot
// changed the state's low bits; deterministic inference needs the same bits wherever
// snapshots fall.
template <typename Vec> inline Vec fmadd(Vec a, float b, Vec c) {
#if defined(__AVX512F__)
  if constexpr (sizeof(Vec) == 64)
    return (Vec)_mm512_fmadd_ps((__m512)a, _mm512_set1_ps(b), (__m512)c);
#endif
#if defined(__FMA__)
  if constexpr (sizeof(Vec) == 32)
    return (Vec)_mm256_fmadd_ps((__m256)a, _mm256_set1_ps(b), (__m256)c);
  if constexpr (sizeof(Vec) == 4) return std::fma(a, b, c);
#endif
#if defined(__FP_FAST_FMAF)  // FMA hardware elsewhere (aarch64): fused lane by lane
  if constexpr (sizeof(Vec) == 4) {
    return __builtin_fmaf(a, b, c);
  } else {
    Vec r;
    for (int l = 0; l < static_cast<int>(sizeof(Vec) / 4); ++l)
      r[l] = __builtin_fmaf(a[l], b, c[l]);
    return r;
  }
#else
  return a * b + c;  // no FMA unit: nothing to contract either
#endif
}

// A prefix-cache snapshot is written once and not read until a later request hits it, so it
// bypasses the caches: a plain store first reads each line of the cold slot (24 snapshots of
// a bench prefill step, 9.4 MB a layer, cost ~5 ms against ~1 ms into one hot slot).
// Aligned whole vectors only (the slot rows are; anything else takes a plain store); the
// caller fences before the states are read.
template <typename Vec> inline void vstore_stream(float* p, Vec x) {
#if defined(__AVX512F__)
  if constexpr (sizeof(Vec) == 64) {
    if ((reinterpret_cast<uintptr_t>(p) & 63) == 0) {
      _mm512_stream_ps(p, (__m512)x);
      return;
    }
  }
#endif
#if defined(__AVX__)
  if constexpr (sizeof(Vec) == 32) {
    if ((reinterpret_cast<uintptr_t>(p) & 31) == 0) {
      _mm256_stream_ps(p, (__m256)x);
      return;
    }
  }
#endif
  vstore(p, x);
}

inline void stream_fence() {
#if defined(__SSE__)
  _mm_sfence();
#endif
}

// One sweep over a column block (N vectors of Vec per state row, rows K apart by V): token
// t's update S += k delta^T and readout o = S^T q, then (kNext) the next token's decay and
// prediction pred = S^T k'. kSnap also copies the updated block to dst.
template <typename Vec, int N, bool kNext, bool kSnap>
inline void sweep(float* __restrict S, const Prepared& in, int64_t r, const Vec* delta,
                  Vec* o, Vec* pred, float* __restrict dst) {
  constexpr int64_t W = sizeof(Vec) / sizeof(float);
  const float* __restrict q = in.qn + r * in.K;
  const float* __restrict k = in.kn + r * in.K;
  const float* __restrict d2 = kNext ? in.decay + (r + in.H) * in.K : nullptr;
  const float* __restrict k2 = kNext ? in.kn + (r + in.H) * in.K : nullptr;
  for (int n = 0; n < N; ++n) o[n] = Vec{};
  if (kNext)
    for (int n = 0; n < N; ++n) pred[n] = Vec{};
  for (int64_t i = 0; i < in.K; ++i) {
    float* row = S + i * in.V;
    for (int n = 0; n < N; ++n) {
      Vec s = fmadd(delta[n], k[i], vload<Vec>(row + n * W));
      o[n] = fmadd(s, q[i], o[n]);
      if (kSnap) vstore_stream(dst + i * in.V + n * W, s);
      if (kNext) {
        s *= d2[i];
        pred[n] = fmadd(s, k2[i], pred[n]);
      }
      vstore(row + n * W, s);
    }
  }
}

// One head's column block [c0, c0 + N W) through rows t0..t1-1 of one sequence.
template <typename Vec, int N>
void scan_columns(const Prepared& in, float* __restrict S, int64_t h, int64_t c0, int64_t t0,
                  int64_t t1, const int64_t* snap, float* snap_base) {
  constexpr int64_t W = sizeof(Vec) / sizeof(float);
  const int64_t H = in.H, K = in.K, V = in.V, slot_stride = H * K * V;
  Vec pred[N], delta[N], o[N];
  {  // the first token's decay and prediction
    const int64_t r = t0 * H + h;
    const float* d = in.decay + r * K;
    const float* k = in.kn + r * K;
    for (int n = 0; n < N; ++n) pred[n] = Vec{};
    for (int64_t i = 0; i < K; ++i)
      for (int n = 0; n < N; ++n) {
        const Vec s = vload<Vec>(S + i * V + n * W) * d[i];
        pred[n] = fmadd(s, k[i], pred[n]);
        vstore(S + i * V + n * W, s);
      }
  }
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t r = t * H + h;
    for (int n = 0; n < N; ++n)
      delta[n] = (vload<Vec>(in.v + t * in.v_stride + h * V + c0 + n * W) - pred[n]) * in.bt[r];
    float* dst = snap != nullptr && snap[t] >= 0 ? snap_base + snap[t] * slot_stride : nullptr;
    const bool next = t + 1 < t1;
    if (dst != nullptr)
      next ? sweep<Vec, N, true, true>(S, in, r, delta, o, pred, dst)
           : sweep<Vec, N, false, true>(S, in, r, delta, o, pred, dst);
    else
      next ? sweep<Vec, N, true, false>(S, in, r, delta, o, pred, dst)
           : sweep<Vec, N, false, false>(S, in, r, delta, o, pred, dst);
    for (int n = 0; n < N; ++n) vstore(in.out + r * V + c0 + n * W, o[n]);
  }
}

}  // namespace

extern "C" {

// Fused KDA steps for B sequences: conv (+ window update), L2 norm, decay gate, beta, the
// gated delta-rule update of the fp32 state in place in the pool, the output and the gated
// RMSNorm. cu [B+1] (nullable: one token per sequence) packs a few tokens per sequence (a
// verify), run token by token with the arithmetic of single decodes, so a verify of n tokens
// leaves the states a run of n decodes would. qkv [T, 2HK+HV] pre-conv; f [T, H, K] raw
// gate; beta [T, H] logits; z [T, H, V] output gate; conv_w [2HK+HV, W]; A_log [H];
// dt_bias [H*K]; norm_w [V]; state [N, H, K, V]; conv_state [N, W-1, 2HK+HV]; slots [B];
// out [T, H, V].
void kda_decode_f32(const float* qkv, const float* f, const float* beta, const float* z,
                    const float* conv_w, const float* A_log, const float* dt_bias,
                    const float* norm_w, float* state, float* conv_state, const int64_t* slots,
                    const int64_t* cu, float* out, int64_t B, int64_t H,
                    int64_t K, int64_t V, int64_t W, float eps, float lower_bound) {
  const int64_t C = 2 * H * K + H * V;
  const float qscale = 1.0f / std::sqrt(static_cast<float>(K));
  // conv_w [C, W] transposed (conv_silu), by the team: on one thread (and zeroed first) it
  // was a third of a one-token call's time, the other thread waiting
  std::unique_ptr<float[]> wt(new float[W * C]);
  float* conv_wt = wt.get();
#pragma omp parallel
  {
#pragma omp for schedule(static)
  for (int64_t c = 0; c < C; ++c)
    for (int64_t j = 0; j < W; ++j) conv_wt[j * C + c] = conv_w[c * W + j];
#pragma omp for schedule(static)
  for (int64_t task = 0; task < B * H; ++task) {
    const int64_t b = task / H, h = task % H, slot = slots[b];
    const int64_t t0 = cu == nullptr ? b : cu[b], t1 = cu == nullptr ? b + 1 : cu[b + 1];
    float q[kMaxDim], k[kMaxDim], v[kMaxDim], decay[kMaxDim], pred[kMaxDim], o[kMaxDim];
    float* cs = conv_state + slot * (W - 1) * C;
    float* S = state + (slot * H + h) * K * V;
    for (int64_t t = t0; t < t1; ++t) {
      const float* x = qkv + t * C;
      conv_silu(x, conv_wt, cs, C, W, h * K, K, q);
      conv_silu(x, conv_wt, cs, C, W, H * K + h * K, K, k);
      conv_silu(x, conv_wt, cs, C, W, 2 * H * K + h * V, V, v);
      l2norm(q, K, qscale);
      l2norm(k, K, 1.0f);
      decay_gate(f + (t * H + h) * K, dt_bias + h * K, A_log[h], K, decay, lower_bound);
      const float bt = sigmoidf(beta[t * H + h]);

      delta_step(S, q, k, v, decay, bt, K, V, pred, o);
      // pred is free again: the gate's scratch
      gated_norm_row(o, z + (t * H + h) * V, norm_w, V, eps, pred, out + (t * H + h) * V);
    }
  }
  }
}

// The KDA output norm over rows of V (`gated_rmsnorm`'s contract, as the decode step computes
// it): o, z, out [rows, V]; w [V].
void gated_rmsnorm_f32(const float* o, const float* z, const float* w, float* out,
                       int64_t rows, int64_t V, float eps) {
#pragma omp parallel for schedule(static) if (rows * V >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    float gate[kMaxDim];
    gated_norm_row(o + r * V, z + r * V, w, V, eps, gate, out + r * V);
  }
}

// Causal depthwise conv + SiLU over B packed sequences (`short_conv`'s contract), continuing
// from and updating each slot's window. x [T, C] with rows x_stride apart (the layer's qkv is
// a column slice of its input projection); out [T, C]; wt [W, C] (the weight transposed, so a
// tap is contiguous over channels and the channel loop vectorises; tap W-1 is the current
// token); conv_state [N, W-1, C] oldest first; slots [B]; cu [B+1].
//
// A token's output needs only inputs (its own and the W-1 before it, from the window for a
// sequence's first W-1 tokens), not an evolving state: the rows are independent tasks, each a
// contiguous pass over whole rows. (Tasks of one sequence and a block of channels, tokens in
// order with the window shifted per token, read 1 KB of every 10 KB input row and ran a
// 2,048-token `bench` chunk at ~7 ms a layer.) The windows are rewritten after every output
// has read them.
void short_conv_f32(const float* x, int64_t x_stride, const float* wt, float* conv_state,
                    const int64_t* slots, const int64_t* cu, float* out, int64_t B, int64_t C,
                    int64_t W) {
  const int64_t T = cu[B];
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t b = std::upper_bound(cu + 1, cu + B + 1, t) - (cu + 1);  // t's sequence
      const int64_t i = t - cu[b];
      const float* cs = conv_state + slots[b] * (W - 1) * C;
      const float* xr = x + t * x_stride;
      const float* wl = wt + (W - 1) * C;
      float* __restrict yr = out + t * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) yr[c] = wl[c] * xr[c];
      for (int64_t j = 0; j < W - 1; ++j) {  // tap j: the input W-1-j tokens back
        const int64_t p = i - (W - 1) + j;
        const float* sj = p >= 0 ? x + (t - (W - 1) + j) * x_stride : cs + (W - 1 + p) * C;
        const float* wj = wt + j * C;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) yr[c] += wj[c] * sj[c];
      }
      map_lanes(yr, yr, C, [](auto a) { return a * vsigmoid(a); });
    }
    // each window's new rows: the sequence's last W-1 inputs, older rows of the window where
    // it had fewer (moved forward: row r takes row r + n > r, not yet rewritten)
#pragma omp for schedule(static)
    for (int64_t b = 0; b < B; ++b) {
      const int64_t n = cu[b + 1] - cu[b];
      float* cs = conv_state + slots[b] * (W - 1) * C;
      for (int64_t r = 0; r < W - 1; ++r) {
        const int64_t pos = n - (W - 1) + r;
        if (pos >= 0)
          std::memcpy(cs + r * C, x + (cu[b] + pos) * x_stride, C * sizeof(float));
        else if (n > 0)
          std::memcpy(cs + r * C, cs + (r + n) * C, C * sizeof(float));
      }
    }
  }
}

// The delta rule over packed prefill sequences (`kda_chunk`'s contract): q, k [T, H, K] post
// conv and v [T, H, V], each token's row `*_stride` floats after the previous one (column
// slices of the conv output need no copy); f [T, H, K] the raw gate, its decay computed here
// as the decode step does (decay_gate); beta [T, H] logits, rows beta_stride apart; sequence
// b is rows cu[b]..cu[b+1] and continues from state slot slots[b]; out [T, H, V] (before the
// norm). snap (nullable) [T]: where snap[t] >= 0 the state after row t is also copied to
// that pool row (prefix-cache snapshots inside a chunk). scratch: 3 T H K + T H floats.
//
// A token-serial scan, split by value columns: column j of the state evolves on its own
// (its prediction k^T S[:, j] and its update need no other column), so each task runs one
// head's block of 2 vectors of columns through the tokens with that block (8-16 KB) in L1.
// One sweep over the block per token: the update and readout of token t fused with the
// decay and prediction of token t+1 (two sweeps per token before: 3.7 us per head-token on
// the bench shapes, the state streaming from L2).
void kda_prefill_f32(const float* q_in, const float* k_in, const float* v_in, int64_t q_stride,
                     int64_t k_stride, int64_t v_stride, const float* f, const float* beta,
                     int64_t beta_stride, const float* A_log, const float* dt_bias,
                     float* state, const int64_t* slots, const int64_t* cu, const int64_t* snap,
                     float* out, int64_t B, int64_t H, int64_t K, int64_t V, int64_t T,
                     float* scratch, float lower_bound) {
  float* qn = scratch;
  float* kn = scratch + T * H * K;
  float* decay = scratch + 2 * T * H * K;
  float* bt = scratch + 3 * T * H * K;
  const float qscale = 1.0f / std::sqrt(static_cast<float>(K));
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < T * H; ++row) {
    const int64_t t = row / H, h = row % H;
    std::memcpy(qn + row * K, q_in + t * q_stride + h * K, K * sizeof(float));
    std::memcpy(kn + row * K, k_in + t * k_stride + h * K, K * sizeof(float));
    l2norm(qn + row * K, K, qscale);
    l2norm(kn + row * K, K, 1.0f);
    decay_gate(f + row * K, dt_bias + h * K, A_log[h], K, decay + row * K, lower_bound);
    bt[row] = sigmoidf(beta[t * beta_stride + h]);
  }
  // column pieces: blocks of 2 vectors, then 1 vector, then single columns
  constexpr int64_t kWide = 2 * kLanes;
  std::vector<std::pair<int64_t, int>> pieces;  // (first column, kind 2 / 1 / 0)
  int64_t c = 0;
  for (; c + kWide <= V; c += kWide) pieces.push_back({c, 2});
  for (; c + kLanes <= V; c += kLanes) pieces.push_back({c, 1});
  for (; c < V; ++c) pieces.push_back({c, 0});
  const int64_t P = static_cast<int64_t>(pieces.size());
  const Prepared in{qn, kn, decay, bt, v_in, out, H, K, V, v_stride};
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t task = 0; task < B * H * P; ++task) {
    const int64_t b = task / (H * P), h = task / P % H;
    const auto [c0, kind] = pieces[task % P];
    const int64_t t0 = cu[b], t1 = cu[b + 1];
    if (t0 == t1) continue;
    float* S = state + (slots[b] * H + h) * K * V + c0;
    float* snap_base = snap == nullptr ? nullptr : state + h * K * V + c0;
    if (kind == 2)
      scan_columns<vtile, 2>(in, S, h, c0, t0, t1, snap, snap_base);
    else if (kind == 1)
      scan_columns<vtile, 1>(in, S, h, c0, t0, t1, snap, snap_base);
    else
      scan_columns<float, 1>(in, S, h, c0, t0, t1, snap, snap_base);
    if (snap != nullptr) stream_fence();  // the streamed snapshot stores, before anyone reads
  }
}

}  // extern "C"
