// Skinny GEMMs and routed experts for decode-sized batches (a few rows), and the bandwidth
// probe; fp32 activations against fp32, bf16 or int8 weights (widened in registers, see
// tiles.h). Built into the same library as kda_cpu.cpp (build.py) and tested against the
// plain-torch references in kdaserve/kernels/ref.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

inline float sigmoidf(float x) { return 1.0f / (1.0f + std::exp(-x)); }

#include "tiles.h"

// Routed experts for a few tokens (decode): E_e(x) = W2 (SiLU(W1 x) * W3 x), weighted and
// summed over each token's k choices.  x [T, D]; ids, weights [T, k]; w13 [E, 2I, D] (gate
// rows then up rows); w2 [E, D, I]; out [T, D].  Choices are grouped by expert (a counting
// sort) so each weight row is read once for all tokens that chose its expert; work is split
// over (expert, block of rows), which keeps both cores busy even for one token.
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


// y [M, N] = x [M, K] @ w [N, K]^T for a few rows (decode). MKL's sgemm packs w on every
// call, which on these shapes reaches about a third of the memory bandwidth (measured on the
// 100k x 768 lm_head: 11.7 GB/s against 30+ here). Here each block of weight rows is streamed
// once per call and dotted with the x rows in register tiles (kTileN weight rows x kTileM x
// rows) while it sits in L2.
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
