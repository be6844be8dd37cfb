// Batch-invariant CPU kernels (fp32): every output element is computed by one fixed sequence
// of floating-point operations that depends only on that element's own inputs, never on how
// many rows share the call, where a row sits in the batch, the pointer alignment, or the thread
// count. This is what deterministic inference needs (tokens and logprobs bit-identical whatever
// a request is batched with, chunked into or cached from); the usual kernels do not give it:
// sgemm picks its blocking from M, torch's vectorised elementwise loops finish with a scalar
// tail (a different exp) whose position depends on the tensor size, and reductions split
// across threads once a tensor is large.
//
// How: reductions run over explicit vectors of the host's width (GCC vector extensions)
// summed lane by lane in order, then a scalar tail; transcendentals are
// scalar libm calls; work is split across threads only over independent outputs; and the file
// is compiled with -ffp-contract=off so no multiply-add is fused in one place and not another.
// The plain-torch references in kernels/ref are the oracle these are tested against.

#include <algorithm>
#include <cmath>
#include <cstdint>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <vector>

namespace {

// The host's tiles (tiles.h): 16 lanes in 4 x 4 tiles with AVX-512, 8 lanes in 8 x 1 on AVX2.
// Values then differ between the two kinds of host, never between calls on one.
#include "tiles.h"

// The one dot product of this file: kLanes partial sums, lanes summed in order (hsum), scalar
// tail. tiles.h's dot_tile gives each of its values exactly these operations, so tiling
// changes speed, never values.
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  vtile acc = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) acc += load_tile(a + j) * load_tile(b + j);
  float s = hsum(acc);
  for (; j < n; ++j) s += a[j] * b[j];
  return s;
}

inline float sigmoidf(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// SwiGLU (beta 0) or K3's SiTU-GLU: beta tanh(g / beta) sigmoid(g) times the up branch, capped
// by linear_beta tanh(u / linear_beta) unless linear_beta is 0.
inline float glu(float g, float u, float beta, float linear_beta) {
  if (beta == 0.0f) return g * sigmoidf(g) * u;
  return beta * std::tanh(g / beta) * sigmoidf(g) *
         (linear_beta == 0.0f ? u : linear_beta * std::tanh(u / linear_beta));
}

// 1 / rms(x) with eps, as KimiRMSNorm: rsqrt(mean(x^2) + eps).
inline float inv_rms(const float* x, int64_t n, float eps) {
  return 1.0f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + eps);
}

// Where bi_moe reads a weight row: fp32 weights in place; MXFP4 rows decoded into the
// caller's scratch (exact: an E2M1 value times a power of two).
struct F32Rows {
  const float* w;
  int64_t n;  // row length
  size_t scratch() const { return 0; }
  const float* row(int64_t r, float*) const { return w + r * n; }
};

struct Mxfp4Rows {
  const uint8_t* packed;  // [rows, n / 2], the low nibble the even element
  const uint8_t* scales;  // [rows, n / 32], E8M0
  int64_t n;
  size_t scratch() const { return static_cast<size_t>(n); }
  const float* row(int64_t r, float* out) const {
    static constexpr float kE2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                        -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
    const uint8_t* p = packed + r * (n / 2);
    const uint8_t* s = scales + r * (n / 32);
    for (int64_t g = 0; g < n / 32; ++g) {
      // 2^(s - 127) as the reference computes it: 2^-127 (subnormal) at 0, infinity at 255
      const float scale = std::ldexp(1.0f, static_cast<int>(s[g]) - 127);
      for (int64_t j = 0; j < 16; ++j) {
        const uint8_t b = p[g * 16 + j];
        out[g * 32 + 2 * j] = kE2M1[b & 0x0F] * scale;
        out[g * 32 + 2 * j + 1] = kE2M1[b >> 4] * scale;
      }
    }
    return out;
  }
};

// Routed experts: sum over each token's k choices, in choice order, of
// weight * W2 (SiLU(W1 x) * W3 x). x [T, D]; ids, weights [T, k]; w13 [E, 2I, D]; w2 [E, D, I].
// Choices are grouped by expert so a weight row is read once for all its tokens; the grouping
// only orders the work, every value is still one dot() of a weight row with a token's row.
// beta, linear_beta: SwiGLU (beta 0) or K3's SiTU-GLU (linear_beta 0: the up branch uncapped)
template <typename Rows>
void bi_moe(const float* x, const int64_t* ids, const float* weights, Rows w13, Rows w2,
            float* out, int64_t T, int64_t k, int64_t E, int64_t I, int64_t D, float beta,
            float linear_beta) {
  const int64_t n = T * k;
  std::vector<int64_t> offset(E + 1, 0), order(n);
  for (int64_t c = 0; c < n; ++c) ++offset[ids[c] + 1];
  for (int64_t e = 0; e < E; ++e) offset[e + 1] += offset[e];
  {
    std::vector<int64_t> fill(offset.begin(), offset.end() - 1);
    for (int64_t c = 0; c < n; ++c) order[fill[ids[c]]++] = c;
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
    std::vector<float> gate(w13.scratch()), up(w13.scratch()), down(w2.scratch());
#pragma omp for schedule(static)
    for (int64_t task = 0; task < A * iblocks; ++task) {
      const int64_t e = active[task / iblocks], r0 = (task % iblocks) * kRows;
      for (int64_t r = r0; r < std::min(I, r0 + kRows); ++r) {
        const float* wg = w13.row(e * 2 * I + r, gate.data());
        const float* wu = w13.row(e * 2 * I + I + r, up.data());
        for (int64_t s = offset[e]; s < offset[e + 1]; ++s) {
          const float* xt = x + (order[s] / k) * D;
          const float g = dot(wg, xt, D), u = dot(wu, xt, D);
          act[s * I + r] = glu(g, u, beta, linear_beta);
        }
      }
    }
#pragma omp for schedule(static)
    for (int64_t task = 0; task < A * dblocks; ++task) {
      const int64_t e = active[task / dblocks], d0 = (task % dblocks) * kRows;
      for (int64_t d = d0; d < std::min(D, d0 + kRows); ++d) {
        const float* wd = w2.row(e * D + d, down.data());
        for (int64_t s = offset[e]; s < offset[e + 1]; ++s)
          ys[order[s] * D + d] = dot(wd, act.data() + s * I, I) * weights[order[s]];
      }
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      float* o = out + t * D;
      for (int64_t d = 0; d < D; ++d) o[d] = ys[t * k * D + d];
      for (int64_t j = 1; j < k; ++j)
        for (int64_t d = 0; d < D; ++d) o[d] += ys[(t * k + j) * D + d];
    }
  }
}

}  // namespace

extern "C" {

// y [M, N] = x [M, K] @ w [N, K]^T.
void bi_linear_f32(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K) {
  constexpr int64_t kRows = 64;  // a block of weight rows stays in L2 while every x row passes
#pragma omp parallel for schedule(static)
  for (int64_t n0 = 0; n0 < N; n0 += kRows) {
    const int64_t n1 = std::min(N, n0 + kRows);
    int64_t n = n0;
    for (; n + kTileN <= n1; n += kTileN) {
      int64_t m = 0;
      for (; m + kTileM <= M; m += kTileM)
        dot_tile<kTileN, kTileM>(w + n * K, x + m * K, y + m * N + n, N, K);
      for (; m < M; ++m) dot_tile<kTileN, 1>(w + n * K, x + m * K, y + m * N + n, N, K);
    }
    for (; n < n1; ++n)
      for (int64_t m = 0; m < M; ++m) y[m * N + n] = dot(w + n * K, x + m * K, K);
  }
}

// y = w * (x / rms(x)) per row of length D (KimiRMSNorm in fp32).
void bi_rms_norm_f32(const float* x, const float* w, float* y, int64_t rows, int64_t D,
                     float eps) {
#pragma omp parallel for schedule(static) if (rows * D >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * D;
    const float s = inv_rms(xr, D, eps);
    for (int64_t i = 0; i < D; ++i) y[r * D + i] = w[i] * (xr[i] * s);
  }
}

// y = w * (o / rms(o)) * sigmoid(z) per row of length D (fla's FusedRMSNormGated).
void bi_gated_rms_norm_f32(const float* o, const float* z, const float* w, float* y,
                           int64_t rows, int64_t D, float eps) {
#pragma omp parallel for schedule(static) if (rows * D >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const float* orow = o + r * D;
    const float s = inv_rms(orow, D, eps);
    for (int64_t i = 0; i < D; ++i) y[r * D + i] = w[i] * (orow[i] * s) * sigmoidf(z[r * D + i]);
  }
}

// y [rows, I] = SiLU(g) * u with gu [rows, 2I] = gate | up.
void bi_silu_mul_f32(const float* gu, float* y, int64_t rows, int64_t I) {
#pragma omp parallel for schedule(static) if (rows * I >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < I; ++i) {
      const float g = gu[r * 2 * I + i];
      y[r * I + i] = g * sigmoidf(g) * gu[r * 2 * I + I + i];
    }
}

// y [rows, I] = SiTU-GLU (glu above) of gu [rows, 2I] = gate | up.
void bi_situ_mul_f32(const float* gu, float* y, int64_t rows, int64_t I, float beta,
                     float linear_beta) {
#pragma omp parallel for schedule(static) if (rows * I >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < I; ++i)
      y[r * I + i] = glu(gu[r * 2 * I + i], gu[r * 2 * I + I + i], beta, linear_beta);
}

// K3's Attention Residuals mix and the RMSNorm after it, per token (attn_res_norm_ref):
// bank [NB, T, D], partial / out [T, D]. Each source's score w_eff . (v / rms(v)) from dot(),
// softmax with scalar exp in source order, the mix summed in source order per element.
void bi_attn_res_norm_f32(const float* bank, int64_t NB, const float* partial,
                          const float* w_eff, float eps, const float* norm_w, float norm_eps,
                          float* out, int64_t T, int64_t D) {
#pragma omp parallel for schedule(static) if (T * D * (NB + 1) >= kParallelMin)
  for (int64_t t = 0; t < T; ++t) {
    std::vector<const float*> src(NB + 1);
    std::vector<float> p(NB + 1);
    float top = -INFINITY;
    for (int64_t j = 0; j <= NB; ++j) {
      src[j] = j < NB ? bank + (j * T + t) * D : partial + t * D;
      p[j] = dot(src[j], w_eff, D) * inv_rms(src[j], D, eps);
      top = std::max(top, p[j]);
    }
    float total = 0.0f;
    for (int64_t j = 0; j <= NB; ++j) total += (p[j] = std::exp(p[j] - top));
    float* o = out + t * D;
    for (int64_t d = 0; d < D; ++d) {
      float m = 0.0f;
      for (int64_t j = 0; j <= NB; ++j) m += (p[j] / total) * src[j][d];
      o[d] = m;
    }
    const float s = inv_rms(o, D, norm_eps);
    for (int64_t d = 0; d < D; ++d) o[d] = norm_w[d] * (o[d] * s);
  }
}

void bi_sigmoid_f32(const float* x, float* y, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) y[i] = sigmoidf(x[i]);
}

// Causal depthwise conv + SiLU over B packed sequences, continuing from and updating each
// slot's window. x, out [T, C]; w [C, W] (tap W-1 is the current token); conv_state
// [N, W-1, C] oldest first; slots [B]; cu [B+1]. Tokens run in order per channel, so a
// sequence fed in one call or split over many gives the same values.
void bi_short_conv_f32(const float* x, const float* w, float* conv_state, const int64_t* slots,
                       const int64_t* cu, float* out, int64_t B, int64_t C, int64_t W) {
  constexpr int64_t kCols = 64;
  const int64_t cblocks = (C + kCols - 1) / kCols;
#pragma omp parallel for schedule(static)
  for (int64_t task = 0; task < B * cblocks; ++task) {
    const int64_t b = task / cblocks, c0 = (task % cblocks) * kCols;
    const int64_t c1 = std::min(C, c0 + kCols);
    float* cs = conv_state + slots[b] * (W - 1) * C;
    for (int64_t t = cu[b]; t < cu[b + 1]; ++t)
      for (int64_t c = c0; c < c1; ++c) {
        const float* wc = w + c * W;
        float acc = 0.0f;
        for (int64_t j = 0; j < W - 1; ++j) acc += cs[j * C + c] * wc[j];
        acc += x[t * C + c] * wc[W - 1];
        for (int64_t j = 0; j + 1 < W - 1; ++j) cs[j * C + c] = cs[(j + 1) * C + c];
        if (W > 1) cs[(W - 2) * C + c] = x[t * C + c];
        out[t * C + c] = acc * sigmoidf(acc);
      }
  }
}

// Weight-absorbed causal MLA over the paged latent cache, any number of new tokens per
// sequence, one (token, head) per task computed the same way whether it is a prefill row or a
// decode row. q_nope [T, H, Dn]; q_pe [T, H, Dr]; kv [NB*BS, R+Dr]; block_table [B, M];
// seq [T] (sequence of each row); pos [T] (its position: it sees cache rows 0..pos);
// w_uk [H, Dn, R] and w_uv [H, Dv, R] with head stride sH (views of kv_b_proj's weight);
// out [T, H, Dv].
void bi_mla_attention_f32(const float* q_nope, const float* q_pe, const float* kv,
                          const int64_t* block_table, const int64_t* seq, const int64_t* pos,
                          const float* w_uk, const float* w_uv, float* out, int64_t T,
                          int64_t H, int64_t Dn, int64_t Dr, int64_t R, int64_t Dv, int64_t sH,
                          int64_t BS, int64_t M, float scale) {
  const int64_t D = R + Dr;
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t task = 0; task < T * H; ++task) {
    const int64_t t = task / H, h = task % H, L = pos[t] + 1;
    const int64_t* table = block_table + seq[t] * M;
    std::vector<float> q_lat(R, 0.0f), o_lat(R, 0.0f), p(L);
    const float* qn = q_nope + task * Dn;
    const float* qp = q_pe + task * Dr;
    for (int64_t d = 0; d < Dn; ++d) {  // q_lat = W_UK,h^T q_nope: d in order per r
      const float qd = qn[d];
      const float* wr = w_uk + h * sH + d * R;
      for (int64_t r = 0; r < R; ++r) q_lat[r] += qd * wr[r];
    }
    float mx = -INFINITY;
    for (int64_t i = 0; i < L; ++i) {
      const float* row = kv + (table[i / BS] * BS + i % BS) * D;
      p[i] = (dot(q_lat.data(), row, R) + dot(qp, row + R, Dr)) * scale;
      mx = std::max(mx, p[i]);
    }
    float sum = 0.0f;
    for (int64_t i = 0; i < L; ++i) sum += (p[i] = std::exp(p[i] - mx));
    for (int64_t i = 0; i < L; ++i) {
      const float* row = kv + (table[i / BS] * BS + i % BS) * D;
      const float a = p[i] / sum;
      for (int64_t r = 0; r < R; ++r) o_lat[r] += a * row[r];
    }
    for (int64_t v = 0; v < Dv; ++v)
      out[task * Dv + v] = dot(o_lat.data(), w_uv + h * sH + v * R, R);
  }
}

void bi_moe_f32(const float* x, const int64_t* ids, const float* weights, const float* w13,
                const float* w2, float* out, int64_t T, int64_t k, int64_t E, int64_t I,
                int64_t D, float beta, float linear_beta) {
  bi_moe(x, ids, weights, F32Rows{w13, D}, F32Rows{w2, I}, out, T, k, E, I, D, beta,
         linear_beta);
}

// The same with MXFP4 experts (kernels/ref/mxfp4.py): w13 / w2 packed uint8 [E, 2I, D/2] /
// [E, D, I/2], s13 / s2 their E8M0 scales [E, 2I, D/32] / [E, D, I/32]. Each weight row is
// decoded exactly to fp32 (code x 2^(s - 127), as dequantize_mxfp4), so every value equals
// bi_moe_f32's on the dequantized weights.
void bi_moe_mxfp4(const float* x, const int64_t* ids, const float* weights, const uint8_t* w13,
                  const uint8_t* s13, const uint8_t* w2, const uint8_t* s2, float* out,
                  int64_t T, int64_t k, int64_t E, int64_t I, int64_t D, float beta,
                  float linear_beta) {
  bi_moe(x, ids, weights, Mxfp4Rows{w13, s13, D}, Mxfp4Rows{w2, s2, I}, out, T, k, E, I, D,
         beta, linear_beta);
}

}  // extern "C"
