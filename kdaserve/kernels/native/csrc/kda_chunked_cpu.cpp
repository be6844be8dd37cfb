// The chunk (WY) form of the KDA prefill, registered as the `native_wy` kda_chunk beside the
// token-serial scan of kda_cpu.cpp; built into the same library (build.py) and tested
// against kdaserve/kernels/ref's kda_chunk_ref.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

#include "kda_common.h"

}  // namespace

extern "C" {

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
                     int64_t B, int64_t H, int64_t K, int64_t V, float lower_bound) {
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
            const float u = fr[i] + dt_bias[h * K + i];  // K3's gate when lower_bound < 0
            const float g = lower_bound < 0.0f ? lower_bound * sigmoidf(a * u)
                                               : -a * softplusf(u);
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

}  // extern "C"
