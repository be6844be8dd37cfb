// Row-wise elementwise ops and block copies of a decode step; built into the kda_cpu library
// (build.py) and tested against plain torch. A decode step calls each a dozen times on a few
// rows, where torch's dispatch (three ops for a SwiGLU: chunk, silu, mul; two strided copies
// per state slot) costs more than the arithmetic.

#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

#include "tiles.h"
#include "vmath.h"

// below this many outputs one thread does it all (an OpenMP team's fork costs more)
constexpr int64_t kParallelMin = 1 << 15;

}  // namespace

extern "C" {

// gu [rows, 2I] (gate | up) -> y [rows, I] = SiLU(gate) * up
void silu_mul_f32(const float* gu, float* y, int64_t rows, int64_t I) {
#pragma omp parallel for schedule(static) if (rows * I >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r)
    silu_mul_row(gu + r * 2 * I, gu + r * 2 * I + I, y + r * I, I);
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
