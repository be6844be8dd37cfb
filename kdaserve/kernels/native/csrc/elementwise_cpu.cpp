// Row-wise elementwise ops of a decode step, fp32; built into the kda_cpu library (build.py)
// and tested against the plain-torch references in kdaserve/kernels. A decode step calls each
// a dozen times on a few rows, where torch's dispatch (three ops for a SwiGLU: chunk, silu,
// mul) costs more than the arithmetic.

#include <cstdint>
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
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gu + r * 2 * I;
    const float* u = g + I;
    float* out = y + r * I;
    int64_t i = 0;
    for (; i + kLanes <= I; i += kLanes) {
      const vtile gv = load_tile(g + i), uv = load_tile(u + i);
      const vtile v = gv * vsigmoid(gv) * uv;
      __builtin_memcpy(out + i, &v, sizeof(v));
    }
    for (; i < I; ++i) out[i] = g[i] * vsigmoid(g[i]) * u[i];
  }
}

}  // extern "C"
