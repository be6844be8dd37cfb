// Row-wise elementwise ops and block copies of a decode step; built into the kda_cpu library
// (build.py) and tested against plain torch. A decode step calls each a dozen times on a few
// rows, where torch's dispatch (three ops for a SwiGLU: chunk, silu, mul; two strided copies
// per state slot) costs more than the arithmetic.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

#include "tiles.h"
#include "vmath.h"

}  // namespace

extern "C" {

// gu [rows, 2I] (gate | up) -> y [rows, I] = SiLU(gate) * up
void silu_mul_f32(const float* gu, float* y, int64_t rows, int64_t I) {
#pragma omp parallel for schedule(static) if (rows * I >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r)
    silu_mul_row(gu + r * 2 * I, gu + r * 2 * I + I, y + r * I, I);
}

// y [n] = x * sigmoid(g): K3's MLA output gate (every lane the same arithmetic, the tail's
// included: vmath.h's functions are templates over a lane and a vector)
void sigmoid_mul_f32(const float* x, const float* g, float* y, int64_t n) {
  constexpr int64_t kChunk = 4096;  // whole vectors, so each chunk's tail is the array's
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t c = 0; c < n; c += kChunk) {
    const int64_t e = std::min(n, c + kChunk);
    int64_t i = c;
    for (; i + kLanes <= e; i += kLanes) {
      const vtile v = load_tile(x + i) * vsigmoid(load_tile(g + i));
      __builtin_memcpy(y + i, &v, sizeof(v));
    }
    for (; i < e; ++i) y[i] = x[i] * vsigmoid(g[i]);
  }
}

// gu [rows, 2I] (gate | up) -> y [rows, I] = SiTU(gate, up) (vmath.h: Glu), K3's dense MLP
void situ_mul_f32(const float* gu, float* y, int64_t rows, int64_t I, float beta,
                  float linear_beta) {
  const Glu act{beta, linear_beta};
#pragma omp parallel for schedule(static) if (rows * I >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) glu_row(act, gu + r * 2 * I, gu + r * 2 * I + I, y + r * I, I);
}

// K3's Attention Residuals mix, then the RMSNorm that always follows it (kernels/ref/
// attn_res.py): per token, the NB bank rows and the partial sum scored by <v / rms(v), w_eff>,
// softmaxed over the NB + 1 sources, the values mixed, then normalised and scaled by norm_w.
// bank [NB, T, D]; partial, out [T, D]; w_eff, norm_w [D]. One pass over each source for
// its dot and square sum, one for the mix: the sources stay in L1/L2 for a token. A null
// norm_w leaves the mix unnormalised (a context drafter's aggregated tap, decode_step.cpp).
void attn_res_norm_f32(const float* bank, int64_t NB, const float* partial, const float* w_eff,
                       float eps, const float* norm_w, float norm_eps, float* out, int64_t T,
                       int64_t D) {
  constexpr int64_t kMaxSources = 64;  // ceil(layers / block) + 1; K3 has 9
#pragma omp parallel for schedule(static) if (T * D * (NB + 1) >= kParallelMin)
  for (int64_t t = 0; t < T; ++t) {
    const float* src[kMaxSources];
    float logit[kMaxSources];
    for (int64_t j = 0; j <= NB; ++j) {
      src[j] = j < NB ? bank + (j * T + t) * D : partial + t * D;
      float dot = 0.0f, ss = 0.0f;
      const float* v = src[j];
#pragma omp simd reduction(+ : dot, ss)
      for (int64_t d = 0; d < D; ++d) {
        dot += v[d] * w_eff[d];
        ss += v[d] * v[d];
      }
      logit[j] = dot / std::sqrt(ss / static_cast<float>(D) + eps);
    }
    float top = logit[0];
    for (int64_t j = 1; j <= NB; ++j) top = std::max(top, logit[j]);
    float total = 0.0f;
    for (int64_t j = 0; j <= NB; ++j) total += (logit[j] = std::exp(logit[j] - top));
    for (int64_t j = 0; j <= NB; ++j) logit[j] /= total;
    float* o = out + t * D;
    float ms = 0.0f;
    for (int64_t d = 0; d < D; ++d) {
      float m = 0.0f;
      for (int64_t j = 0; j <= NB; ++j) m += logit[j] * src[j][d];
      o[d] = m;
      ms += m * m;
    }
    if (norm_w == nullptr) continue;
    const float r = 1.0f / std::sqrt(ms / static_cast<float>(D) + norm_eps);
    for (int64_t d = 0; d < D; ++d) o[d] = norm_w[d] * (o[d] * r);
  }
}

// y [rows, D] = w * (x / rms(x)) per row (T5-style, KimiRMSNorm: normalised in fp32, then
// scaled by the weight); x rows of stride x_stride (a column slice of a wider output).
void rms_norm_f32(const float* x, int64_t x_stride, const float* w, float* y, int64_t rows,
                  int64_t D, float eps) {
#pragma omp parallel for schedule(static) if (rows * D >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * x_stride;
    vtile acc = {};
    int64_t i = 0;
    for (; i + kLanes <= D; i += kLanes) {
      const vtile v = load_tile(xr + i);
      acc += v * v;
    }
    float ss = hsum_tree(acc);
    for (; i < D; ++i) ss += xr[i] * xr[i];
    const float s = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
    for (int64_t j = 0; j < D; ++j) y[r * D + j] = w[j] * (xr[j] * s);
  }
}

// out[r] = the index of row r's largest value, the first one where several are equal, or of
// its first NaN if it has one (torch.argmax's answer). Per lane the first largest value and
// its index, then the lanes merged by value and index: torch's reduction is scalar (64 rows
// of a 100k vocabulary: 8.4 ms a greedy step).
void argmax_rows_f32(const float* x, int64_t rows, int64_t V, int64_t* out) {
  typedef int32_t vi32 __attribute__((vector_size(sizeof(vtile))));
#pragma omp parallel for schedule(static) if (rows * V >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * V;
    float bv = -INFINITY;
    int64_t b = 0, i = 0;
    bool nan = false;
    if (V >= kLanes) {
      vi32 lane, bi;
      for (int l = 0; l < kLanes; ++l) lane[l] = l;
      vtile best = load_tile(xr);
      bi = lane;
      vi32 nans = best != best;
      for (i = kLanes; i + kLanes <= V; i += kLanes) {
        const vtile v = load_tile(xr + i);
        const vi32 gt = v > best;
        best = gt ? v : best;
        bi = gt ? lane + static_cast<int32_t>(i) : bi;
        nans |= v != v;
      }
      bv = best[0];
      b = bi[0];
      for (int l = 0; l < kLanes; ++l) {
        nan = nan || nans[l] != 0;
        if (best[l] > bv || (best[l] == bv && bi[l] < b)) {
          bv = best[l];
          b = bi[l];
        }
      }
    }
    for (; i < V; ++i) {
      nan = nan || xr[i] != xr[i];
      if (xr[i] > bv || (b == 0 && i == 0)) {
        bv = xr[i];
        b = i;
      }
    }
    if (nan)
      for (int64_t j = 0; j < V; ++j)
        if (xr[j] != xr[j]) {
          b = j;
          break;
        }
    out[r] = b;
  }
}

// For each of n (src, dst) pairs and each of L layers: the block of `bytes` at
// base + l * layer_stride + src * bytes copied to the same place for dst (a state pool's
// slots, [L, N, ...]: a speculative verify saves and restores every verifying request's slot
// around its forward, 2 x L strided torch copies a request otherwise).
void copy_blocks(char* base, int64_t L, int64_t layer_stride, int64_t bytes,
                 const int64_t* src, const int64_t* dst, int64_t n) {
#pragma omp parallel for schedule(static) if (n * L * bytes >= (1 << 18))
  for (int64_t task = 0; task < n * L; ++task) {
    const int64_t i = task / L, l = task % L;
    char* layer = base + l * layer_stride;
    std::memcpy(layer + dst[i] * bytes, layer + src[i] * bytes, bytes);
  }
}

}  // extern "C"
