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
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

constexpr int kMaxDim = 512;  // head dims above this are refused on the Python side

inline float sigmoidf(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// torch.nn.functional.softplus(beta=1, threshold=20): identity above the threshold.
inline float softplusf(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

// One channel group of one head through the causal depthwise conv + SiLU, shifting the
// conv window in place. cs: the slot's [W-1, C] window (time-major), x: this token's [C] row.
void conv_silu(const float* __restrict x, const float* __restrict w, float* __restrict cs,
               int64_t C, int64_t W, int64_t first, int64_t n, float* __restrict y) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t c = first + i;
    const float* wc = w + c * W;
    float acc = wc[W - 1] * x[c];
    for (int64_t j = 0; j < W - 1; ++j) acc += wc[j] * cs[j * C + c];
    for (int64_t j = 0; j + 1 < W - 1; ++j) cs[j * C + c] = cs[(j + 1) * C + c];
    if (W > 1) cs[(W - 2) * C + c] = x[c];
    y[i] = acc * sigmoidf(acc);
  }
}

// fla's l2norm (eps added to the sum of squares), times an extra scale.
void l2norm(float* __restrict x, int64_t n, float scale) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = scale / std::sqrt(ss + 1e-6f);
  for (int64_t i = 0; i < n; ++i) x[i] *= r;
}

// One gated delta-rule step on a head's [K, V] fp32 state, in place; q and k already
// L2-normalised (q also scaled). Writes the output row o [V]; tmp is [V] scratch.
void delta_step(float* __restrict S, const float* __restrict q, const float* __restrict k,
                const float* __restrict v, const float* __restrict decay, float beta, int64_t K,
                int64_t V, float* __restrict tmp, float* __restrict o) {
  // Pass 1: decay the state and predict v from it (k^T S).
  for (int64_t j = 0; j < V; ++j) tmp[j] = 0.0f;
  for (int64_t i = 0; i < K; ++i) {
    float* __restrict row = S + i * V;
    const float d = decay[i], ki = k[i];
    for (int64_t j = 0; j < V; ++j) {
      row[j] *= d;
      tmp[j] += ki * row[j];
    }
  }
  for (int64_t j = 0; j < V; ++j) tmp[j] = (v[j] - tmp[j]) * beta;  // the delta
  // Pass 2 (the head's state is still in L2): rank-1 update, then read out with q.
  for (int64_t j = 0; j < V; ++j) o[j] = 0.0f;
  for (int64_t i = 0; i < K; ++i) {
    float* __restrict row = S + i * V;
    const float ki = k[i], qi = q[i];
    for (int64_t j = 0; j < V; ++j) {
      row[j] += ki * tmp[j];
      o[j] += qi * row[j];
    }
  }
}

// decay = exp(-exp(A_log) * softplus(f + dt_bias)) for one head's K channels.
void decay_gate(const float* __restrict f, const float* __restrict dt_bias, float A_log,
                int64_t K, float* __restrict decay) {
  const float a = std::exp(A_log);
  for (int64_t i = 0; i < K; ++i) decay[i] = std::exp(-a * softplusf(f[i] + dt_bias[i]));
}

// The vector the linear tiles accumulate in, and their shape, by host: with AVX-512 (32
// registers) 16-lane vectors in 4 x 4 tiles; on AVX2 (16 registers) GCC splits a 16-lane type
// into register pairs and a 4 x 4 tile spills, so 8 lanes in 8 x 1 tiles (lm_head 100k x 768,
// weight GB/s at 4 / 8 / 16 / 32 rows: 6.8 / 3.6 / 1.9 / 1.0 before, 22.6 / 17.1 / 11.2 / 6.6
// after, measured on this AVX2 machine).
#if defined(__AVX512F__)
typedef float vtile __attribute__((vector_size(64)));
constexpr int kTileN = 4, kTileM = 4;
#else
typedef float vtile __attribute__((vector_size(32)));
constexpr int kTileN = 8, kTileM = 1;
#endif
constexpr int kLanes = sizeof(vtile) / sizeof(float);

inline vtile load_tile(const float* p) {
  vtile v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

// Weights are fp32 or bf16 (weight-only bf16: half the bytes a decode step streams; the
// activations and every sum stay fp32). A bf16 value is the top half of an fp32 one, so
// widening is a 16-bit shift, done in registers as the weights arrive.
typedef uint16_t bf16;
typedef uint16_t vtile_bf16 __attribute__((vector_size(sizeof(vtile) / 2)));
typedef uint32_t vtile_u32 __attribute__((vector_size(sizeof(vtile))));

inline vtile load_tile(const bf16* p) {
  vtile_bf16 h;
  __builtin_memcpy(&h, p, sizeof(h));
  const vtile_u32 u = __builtin_convertvector(h, vtile_u32) << 16;
  vtile v;
  __builtin_memcpy(&v, &u, sizeof(v));
  return v;
}

// int8 weights (weight-only int8, a scale per output row applied to each finished sum): a
// quarter of the fp32 bytes, converted in registers like bf16.
typedef int8_t vtile_i8 __attribute__((vector_size(sizeof(vtile) / 4)));

inline vtile load_tile(const int8_t* p) {
  vtile_i8 q;
  __builtin_memcpy(&q, p, sizeof(q));
  return __builtin_convertvector(q, vtile);
}

inline float widen(int8_t w) { return static_cast<float>(w); }
inline float widen(float w) { return w; }
inline float widen(bf16 w) {
  const uint32_t u = static_cast<uint32_t>(w) << 16;
  float f;
  __builtin_memcpy(&f, &u, sizeof(f));
  return f;
}

// TN weight rows (stride K) dotted with TM x rows (stride K); y[tm * N + tn].
template <int TN, int TM, typename W>
inline void dot_tile(const W* __restrict w, const float* __restrict x, float* __restrict y,
                     int64_t N, int64_t K) {
  vtile acc[TN][TM] = {};
  int64_t j = 0;
  for (; j + kLanes <= K; j += kLanes) {
    vtile xv[TM];
    for (int tm = 0; tm < TM; ++tm) xv[tm] = load_tile(x + tm * K + j);
    for (int tn = 0; tn < TN; ++tn) {
      const vtile wv = load_tile(w + tn * K + j);
      for (int tm = 0; tm < TM; ++tm) acc[tn][tm] += wv * xv[tm];
    }
  }
  for (int tn = 0; tn < TN; ++tn)
    for (int tm = 0; tm < TM; ++tm) {
      float sum = 0.0f;
      for (int l = 0; l < kLanes; ++l) sum += acc[tn][tm][l];
      for (int64_t l = j; l < K; ++l) sum += widen(w[tn * K + l]) * x[tm * K + l];
      y[tm * N + tn] = sum;
    }
}

}  // namespace

extern "C" {

// Fused KDA decode for B sequences: conv (+ window update), L2 norm, decay gate, beta, the
// gated delta-rule update of the fp32 state in place in the pool, the output and the gated
// RMSNorm.  qkv [B, 2HK+HV] pre-conv; f [B, H, K] raw gate; beta [B, H] logits; z [B, H, V]
// output gate; conv_w [2HK+HV, W]; A_log [H]; dt_bias [H*K]; norm_w [V];
// state [N, H, K, V]; conv_state [N, W-1, 2HK+HV]; slots [B]; out [B, H, V].
void kda_decode_f32(const float* qkv, const float* f, const float* beta, const float* z,
                    const float* conv_w, const float* A_log, const float* dt_bias,
                    const float* norm_w, float* state, float* conv_state, const int64_t* slots,
                    float* out, int64_t B, int64_t H, int64_t K, int64_t V, int64_t W,
                    float eps) {
  const int64_t C = 2 * H * K + H * V;
  const float qscale = 1.0f / std::sqrt(static_cast<float>(K));
#pragma omp parallel for schedule(static)
  for (int64_t task = 0; task < B * H; ++task) {
    const int64_t b = task / H, h = task % H, slot = slots[b];
    float q[kMaxDim], k[kMaxDim], v[kMaxDim], decay[kMaxDim], pred[kMaxDim], o[kMaxDim];
    const float* x = qkv + b * C;
    float* cs = conv_state + slot * (W - 1) * C;
    conv_silu(x, conv_w, cs, C, W, h * K, K, q);
    conv_silu(x, conv_w, cs, C, W, H * K + h * K, K, k);
    conv_silu(x, conv_w, cs, C, W, 2 * H * K + h * V, V, v);
    l2norm(q, K, qscale);
    l2norm(k, K, 1.0f);
    decay_gate(f + (b * H + h) * K, dt_bias + h * K, A_log[h], K, decay);
    const float bt = sigmoidf(beta[b * H + h]);

    delta_step(state + (slot * H + h) * K * V, q, k, v, decay, bt, K, V, pred, o);
    float ms = 0.0f;
#pragma omp simd reduction(+ : ms)
    for (int64_t j = 0; j < V; ++j) ms += o[j] * o[j];
    const float r = 1.0f / std::sqrt(ms / static_cast<float>(V) + eps);
    const float* zr = z + (b * H + h) * V;
    float* dst = out + (b * H + h) * V;
    for (int64_t j = 0; j < V; ++j) dst[j] = norm_w[j] * (o[j] * r) * sigmoidf(zr[j]);
  }
}

// The delta rule over packed prefill sequences (`kda_chunk`'s contract): q, k [T, H, K] post
// conv, v [T, H, V], f [T, H, K] raw gate, beta [T, H] logits; sequence b is rows
// cu[b]..cu[b+1] and continues from state slot slots[b]; out [T, H, V] (before the norm).
// A token-serial scan per (sequence, head): the head's 64 KB state stays in L2 and each
// token costs 4KV flops, less than the chunk form's [C, C, K] pairwise decays cost here.
// snap (nullable) [T]: where snap[t] >= 0 the state after row t is also copied to that
// pool row (prefix-cache snapshots inside a chunk).
void kda_prefill_f32(const float* q_in, const float* k_in, const float* v_in, const float* f,
                     const float* beta, const float* A_log, const float* dt_bias, float* state,
                     const int64_t* slots, const int64_t* cu, const int64_t* snap, float* out,
                     int64_t B, int64_t H, int64_t K, int64_t V) {
  const float qscale = 1.0f / std::sqrt(static_cast<float>(K));
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t task = 0; task < B * H; ++task) {
    const int64_t b = task / H, h = task % H;
    float q[kMaxDim], k[kMaxDim], decay[kMaxDim], tmp[kMaxDim];
    float* S = state + (slots[b] * H + h) * K * V;
    for (int64_t t = cu[b]; t < cu[b + 1]; ++t) {
      const int64_t row = t * H + h;
      for (int64_t i = 0; i < K; ++i) q[i] = q_in[row * K + i];
      for (int64_t i = 0; i < K; ++i) k[i] = k_in[row * K + i];
      l2norm(q, K, qscale);
      l2norm(k, K, 1.0f);
      decay_gate(f + row * K, dt_bias + h * K, A_log[h], K, decay);
      delta_step(S, q, k, v_in + row * V, decay, sigmoidf(beta[row]), K, V, tmp,
                 out + row * V);
      if (snap != nullptr && snap[t] >= 0) {
        float* dst = state + (snap[t] * H + h) * K * V;
        for (int64_t i = 0; i < K * V; ++i) dst[i] = S[i];
      }
    }
  }
}

// The chunk (WY / UT) form of the same delta rule (`kda_chunk`'s contract, as
// kda_prefill_f32, same snap). Per (sequence, head) and chunk of up to kChunk tokens (a chunk
// also ends at a snapshot row): intra-chunk pairwise terms with decays exp(G_r - G_i) (never
// exp(G) alone, which overflows for strong decay), M = (I + L)^-1 diag(beta) by forward
// substitution, then three passes over the state per chunk instead of two per token.
// Measured on the bench shapes (900 tokens x 6 heads x 128): 35 / 36 / 67 / 149 ms at chunks
// of 8 / 16 / 32 / 64 against 17 ms for the scan, whose state stays in L2 anyway: the O(C)
// pairwise terms per token (each with an exp) cost more than the passes it saves. So the
// scan is the `native` kda_chunk and this one is registered below it, as `native_wy`.
constexpr int kChunk = 16;

void kda_chunked_f32(const float* q_in, const float* k_in, const float* v_in, const float* f,
                     const float* beta, const float* A_log, const float* dt_bias, float* state,
                     const int64_t* slots, const int64_t* cu, const int64_t* snap, float* out,
                     int64_t B, int64_t H, int64_t K, int64_t V) {
  const float qscale = 1.0f / std::sqrt(static_cast<float>(K));
#pragma omp parallel
  {
    // per-thread scratch: chunk rows of q, k, cumulative log-decay G, v, and the C x C terms
    std::vector<float> q(kChunk * K), k(kChunk * K), G(kChunk * K), W(kChunk * K),
        qg(kChunk * K), kd(kChunk * K), vp(kChunk * V), o(kChunk * V);
    float L[kChunk][kChunk], Aqk[kChunk][kChunk], X[kChunk][kChunk], bt[kChunk];
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < B * H; ++task) {
      const int64_t b = task / H, h = task % H;
      float* __restrict S = state + (slots[b] * H + h) * K * V;
      const float a = std::exp(A_log[h]);
      for (int64_t t0 = cu[b]; t0 < cu[b + 1];) {
        int64_t n = std::min<int64_t>(kChunk, cu[b + 1] - t0);
        if (snap != nullptr)
          for (int64_t r = 0; r + 1 < n; ++r)
            if (snap[t0 + r] >= 0) { n = r + 1; break; }
        for (int64_t r = 0; r < n; ++r) {
          const int64_t row = (t0 + r) * H + h;
          float* qr = q.data() + r * K;
          float* kr = k.data() + r * K;
          float* Gr = G.data() + r * K;
          for (int64_t i = 0; i < K; ++i) qr[i] = q_in[row * K + i];
          for (int64_t i = 0; i < K; ++i) kr[i] = k_in[row * K + i];
          l2norm(qr, K, qscale);
          l2norm(kr, K, 1.0f);
          const float* fr = f + row * K;
          for (int64_t i = 0; i < K; ++i) {
            const float g = -a * softplusf(fr[i] + dt_bias[h * K + i]);
            Gr[i] = (r ? G[(r - 1) * K + i] : 0.0f) + g;
          }
          bt[r] = sigmoidf(beta[row]);
          for (int64_t j = 0; j < V; ++j) vp[r * V + j] = v_in[row * V + j];
        }
        // pairwise terms: L (strict, times beta_r) and Aqk (inclusive)
        for (int64_t r = 0; r < n; ++r)
          for (int64_t i = 0; i <= r; ++i) {
            const float *qr = q.data() + r * K, *kr = k.data() + r * K, *ki = k.data() + i * K;
            const float *Gr = G.data() + r * K, *Gi = G.data() + i * K;
            float dk = 0.0f, dq = 0.0f;
#pragma omp simd reduction(+ : dk, dq)
            for (int64_t c = 0; c < K; ++c) {
              const float e = std::exp(Gr[c] - Gi[c]) * ki[c];
              dk += kr[c] * e;
              dq += qr[c] * e;
            }
            Aqk[r][i] = dq;
            L[r][i] = i < r ? bt[r] * dk : 0.0f;
          }
        // X = (I + L)^-1 (unit lower triangular); M = X diag(beta)
        for (int64_t r = 0; r < n; ++r)
          for (int64_t c = 0; c < n; ++c) {
            float x = r == c ? 1.0f : 0.0f;
            for (int64_t i = c; i < r; ++i) x -= L[r][i] * X[i][c];
            X[r][c] = c <= r ? x : 0.0f;
          }
        // U = M v (into vp, in place from the last row up), W = M (gamma * k)
        for (int64_t r = n - 1; r >= 0; --r) {
          float* ur = vp.data() + r * V;
          float* wr = W.data() + r * K;
          for (int64_t j = 0; j < V; ++j) ur[j] *= X[r][r] * bt[r];
          for (int64_t c = 0; c < r; ++c) {
            const float m = X[r][c] * bt[c];
            const float* vc = vp.data() + c * V;
            for (int64_t j = 0; j < V; ++j) ur[j] += m * vc[j];
          }
          for (int64_t i = 0; i < K; ++i) wr[i] = 0.0f;
          for (int64_t c = 0; c <= r; ++c) {
            const float m = X[r][c] * bt[c];
            const float *kc = k.data() + c * K, *Gc = G.data() + c * K;
            for (int64_t i = 0; i < K; ++i) wr[i] += m * std::exp(Gc[i]) * kc[i];
          }
        }
        const float* Gl = G.data() + (n - 1) * K;
        for (int64_t r = 0; r < n; ++r)
          for (int64_t i = 0; i < K; ++i) {
            qg[r * K + i] = q[r * K + i] * std::exp(G[r * K + i]);
            kd[r * K + i] = k[r * K + i] * std::exp(Gl[i] - G[r * K + i]);
          }
        // pass over S: Vp = U - W S and o = (q * gamma) S
        std::fill(o.begin(), o.begin() + n * V, 0.0f);
        for (int64_t i = 0; i < K; ++i) {
          const float* __restrict Si = S + i * V;
          for (int64_t r = 0; r < n; ++r) {
            const float w = W[r * K + i], qq = qg[r * K + i];
            float* __restrict ur = vp.data() + r * V;
            float* __restrict orow = o.data() + r * V;
            for (int64_t j = 0; j < V; ++j) {
              ur[j] -= w * Si[j];
              orow[j] += qq * Si[j];
            }
          }
        }
        // o += Aqk Vp, written out
        for (int64_t r = 0; r < n; ++r) {
          float* __restrict orow = o.data() + r * V;
          for (int64_t i = 0; i <= r; ++i) {
            const float c = Aqk[r][i];
            const float* __restrict ui = vp.data() + i * V;
            for (int64_t j = 0; j < V; ++j) orow[j] += c * ui[j];
          }
          float* dst = out + ((t0 + r) * H + h) * V;
          for (int64_t j = 0; j < V; ++j) dst[j] = orow[j];
        }
        // S = S * exp(G_last) + (k * exp(G_last - G))^T Vp
        for (int64_t i = 0; i < K; ++i) {
          float* __restrict Si = S + i * V;
          const float d = std::exp(Gl[i]);
          for (int64_t j = 0; j < V; ++j) Si[j] *= d;
          for (int64_t r = 0; r < n; ++r) {
            const float c = kd[r * K + i];
            const float* __restrict ur = vp.data() + r * V;
            for (int64_t j = 0; j < V; ++j) Si[j] += c * ur[j];
          }
        }
        if (snap != nullptr && snap[t0 + n - 1] >= 0) {
          float* dst = state + (snap[t0 + n - 1] * H + h) * K * V;
          for (int64_t i = 0; i < K * V; ++i) dst[i] = S[i];
        }
        t0 += n;
      }
    }
  }
}

// Routed experts for a few tokens (decode): E_e(x) = W2 (SiLU(W1 x) * W3 x), weighted and
// summed over each token's k choices.  x [T, D]; ids, weights [T, k]; w13 [E, 2I, D] (gate
// rows then up rows); w2 [E, D, I]; out [T, D].  Choices are grouped by expert (a counting
// sort) so each weight row is read once for all tokens that chose its expert; work is split
// over (expert, block of rows), which keeps both cores busy even for one token.
}  // extern "C"

namespace {

// s13 [E, 2I] and s2 [E, D] (nullable): int8 weights' per-row scales.
template <typename W>
void moe_decode(const float* x, const int64_t* ids, const float* weights, const W* w13,
                const W* w2, const float* s13, const float* s2, float* out, int64_t T, int64_t k,
                int64_t E, int64_t I, int64_t D) {
  const int64_t n = T * k;
  std::vector<int64_t> offset(E + 1, 0), order(n);
  for (int64_t c = 0; c < n; ++c) ++offset[ids[c] + 1];
  for (int64_t e = 0; e < E; ++e) offset[e + 1] += offset[e];
  {
    std::vector<int64_t> fill(offset.begin(), offset.end() - 1);
    for (int64_t c = 0; c < n; ++c) order[fill[ids[c]]++] = c;  // sorted position -> choice
  }
  std::vector<int64_t> active;
  for (int64_t e = 0; e < E; ++e)
    if (offset[e + 1] > offset[e]) active.push_back(e);
  const int64_t A = static_cast<int64_t>(active.size());
  std::vector<float> act(n * I), ys(n * D);
  constexpr int64_t kRows = 32;
  const int64_t iblocks = (I + kRows - 1) / kRows, dblocks = (D + kRows - 1) / kRows;
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t task = 0; task < A * iblocks; ++task) {
      const int64_t e = active[task / iblocks], r0 = (task % iblocks) * kRows;
      for (int64_t r = r0; r < std::min(I, r0 + kRows); ++r) {
        const W* __restrict wg = w13 + (e * 2 * I + r) * D;
        const W* __restrict wu = wg + I * D;
        for (int64_t s = offset[e]; s < offset[e + 1]; ++s) {
          const float* __restrict xt = x + (order[s] / k) * D;
          float g = 0.0f, u = 0.0f;
#pragma omp simd reduction(+ : g, u)
          for (int64_t d = 0; d < D; ++d) {
            g += widen(wg[d]) * xt[d];
            u += widen(wu[d]) * xt[d];
          }
          if (s13 != nullptr) {
            g *= s13[e * 2 * I + r];
            u *= s13[e * 2 * I + I + r];
          }
          act[s * I + r] = g * sigmoidf(g) * u;
        }
      }
    }
#pragma omp for schedule(static)
    for (int64_t task = 0; task < A * dblocks; ++task) {
      const int64_t e = active[task / dblocks], d0 = (task % dblocks) * kRows;
      for (int64_t d = d0; d < std::min(D, d0 + kRows); ++d) {
        const W* __restrict wd = w2 + (e * D + d) * I;
        for (int64_t s = offset[e]; s < offset[e + 1]; ++s) {
          const float* __restrict a = act.data() + s * I;
          float y = 0.0f;
#pragma omp simd reduction(+ : y)
          for (int64_t i = 0; i < I; ++i) y += widen(wd[i]) * a[i];
          if (s2 != nullptr) y *= s2[e * D + d];
          ys[order[s] * D + d] = y * weights[order[s]];  // ys is indexed by choice
        }
      }
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      float* __restrict o = out + t * D;
      for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
      for (int64_t j = 0; j < k; ++j) {
        const float* __restrict y = ys.data() + (t * k + j) * D;
        for (int64_t d = 0; d < D; ++d) o[d] += y[d];
      }
    }
  }
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

// y [M, N] = x [M, K] @ w [N, K]^T for a few rows (decode). MKL's sgemm packs w on every
// call, which on these shapes reaches about a third of the memory bandwidth (measured on the
// 100k x 768 lm_head: 11.7 GB/s against 30+ here). Here each block of weight rows is streamed
// once per call and dotted with the x rows in register tiles (kTileN weight rows x kTileM x
// rows) while it sits in L2.
}  // extern "C"

namespace {

// Rows [n0, n1) of y = x w^T, the block's weight rows starting at wb (row n0).
template <typename W>
void linear_block(const float* x, const W* wb, float* y, int64_t M, int64_t N, int64_t K,
                  int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (M < 4) {  // bandwidth-bound: a plain dot per (row, x) streams fastest (measured)
    for (; n < n1; ++n)
      for (int64_t m = 0; m < M; ++m) {
        const W* __restrict wr = wb + (n - n0) * K;
        const float* __restrict xr = x + m * K;
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t j = 0; j < K; ++j) acc += widen(wr[j]) * xr[j];
        y[m * N + n] = acc;
      }
  }
  for (; n + kTileN <= n1; n += kTileN) {
    const W* wr = wb + (n - n0) * K;
    int64_t m = 0;
    for (; m + kTileM <= M; m += kTileM)
      dot_tile<kTileN, kTileM>(wr, x + m * K, y + m * N + n, N, K);
    for (; m < M; ++m) dot_tile<kTileN, 1>(wr, x + m * K, y + m * N + n, N, K);
  }
  for (; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m)
      dot_tile<1, 1>(wb + (n - n0) * K, x + m * K, y + m * N + n, N, K);
}

// scale (nullable) [N]: multiplies output column n (int8 weights' per-row scales).
template <typename W>
void linear_small(const float* x, const W* w, const float* scale, float* y, int64_t M,
                  int64_t N, int64_t K) {
  constexpr int64_t kRows = 64;
#pragma omp parallel
  {
    std::vector<float> wide;  // bf16 weights with several x rows: widened once per block
#pragma omp for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += kRows) {
      const int64_t n1 = std::min(N, n0 + kRows);
      if (!std::is_same<W, float>::value && M >= 4) {
        wide.resize((n1 - n0) * K);
        for (int64_t i = 0; i < (n1 - n0) * K; ++i) wide[i] = widen(w[n0 * K + i]);
        linear_block(x, wide.data(), y, M, N, K, n0, n1);
      } else {
        linear_block(x, w + n0 * K, y, M, N, K, n0, n1);
      }
      if (scale != nullptr)
        for (int64_t m = 0; m < M; ++m)
          for (int64_t n = n0; n < n1; ++n) y[m * N + n] *= scale[n];
    }
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

// Weight-absorbed MLA decode straight from the paged latent cache.  q_lat [B, H, R] (q_nope
// already multiplied by W_UK); q_pe [B, H, Dr]; kv [NB*BS, R+Dr] rows; block_table [B, M];
// context_lens [B]; out [B, H, R] attention-weighted latents (W_UV is applied by the caller).
void mla_decode_f32(const float* q_lat, const float* q_pe, const float* kv,
                    const int64_t* block_table, const int64_t* context_lens, float* out,
                    int64_t B, int64_t H, int64_t R, int64_t Dr, int64_t BS, int64_t M,
                    float scale) {
  const int64_t D = R + Dr;
  // (b, h) tasks: a thread takes consecutive heads of one sequence, whose latents then stay
  // in its cache between heads.
#pragma omp parallel for schedule(static)
  for (int64_t task = 0; task < B * H; ++task) {
    const int64_t b = task / H, L = context_lens[b];
    const float* __restrict ql = q_lat + task * R;
    const float* __restrict qp = q_pe + task * Dr;
    const int64_t* table = block_table + b * M;
    std::vector<float> p(static_cast<size_t>(L));
    float mx = -INFINITY;
    for (int64_t t = 0; t < L; ++t) {
      const float* __restrict row = kv + (table[t / BS] * BS + t % BS) * D;
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int64_t r = 0; r < R; ++r) s += ql[r] * row[r];
#pragma omp simd reduction(+ : s)
      for (int64_t r = 0; r < Dr; ++r) s += qp[r] * row[R + r];
      p[t] = s * scale;
      mx = p[t] > mx ? p[t] : mx;
    }
    float sum = 0.0f;
    for (int64_t t = 0; t < L; ++t) sum += (p[t] = std::exp(p[t] - mx));
    float* __restrict o = out + task * R;
    for (int64_t r = 0; r < R; ++r) o[r] = 0.0f;
    for (int64_t t = 0; t < L; ++t) {
      const float* __restrict row = kv + (table[t / BS] * BS + t % BS) * D;
      const float w = p[t] / sum;
      for (int64_t r = 0; r < R; ++r) o[r] += w * row[r];
    }
  }
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
