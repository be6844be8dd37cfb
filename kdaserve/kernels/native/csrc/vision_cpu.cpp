// The vision tower's elementwise ops, fp32 or bf16 (the tower computes in bf16 on hosts with
// bf16 units): the tanh GELU of its MLP and its 2-D RoPE on interleaved pairs. Built into the
// kda_cpu library (build.py), tested against the plain-torch references in
// kernels/ref/vision.py. torch ran them at ~1 G elements/s on a 2-core Zen 4 (the RoPE as
// eight ops: two fp32 copies, cos and sin per call, the products, a stack), 13% of a 448-pixel
// image's tower time beside the GEMMs and attention; here each is one pass, every value
// computed in fp32 and rounded to the output's dtype once.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <omp.h>

namespace {

#include "tiles.h"
#include "vmath.h"

constexpr int64_t kMaxRope = 512;  // head dims the RoPE takes
#if defined(__AVX512F__)
const vtile_i32 kSwapPairs = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
#else
const vtile_i32 kSwapPairs = {1, 0, 3, 2, 5, 4, 7, 6};
#endif

// fp32 -> bf16 rounded to nearest even, as torch's .to(bfloat16) (no NaN among these values)
inline void store(float* p, vtile v) { __builtin_memcpy(p, &v, sizeof(v)); }
inline void store(bf16* p, vtile v) {
  vtile_u32 u;
  __builtin_memcpy(&u, &v, sizeof(u));
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const vtile_bf16 h = __builtin_convertvector(u, vtile_bf16);
  __builtin_memcpy(p, &h, sizeof(h));
}
inline void store1(float* p, float v) { *p = v; }
inline void store1(bf16* p, float v) {
  uint32_t u;
  __builtin_memcpy(&u, &v, sizeof(u));
  *p = static_cast<bf16>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3): torch's approximate="tanh", as
// x sigmoid(2u) (the same function), whose tail for negative x keeps its digits where 1 +
// tanh(u) would cancel to nothing
template <typename V> inline V gelu_tanh(V x) {
  return x * vsigmoid(1.5957691216057308f * (x + 0.044715f * x * x * x));
}

template <typename T> void gelu_rows(const T* x, T* y, int64_t n) {
  constexpr int64_t kChunk = 8192;  // whole vectors: each chunk's tail is the array's
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t c = 0; c < n; c += kChunk) {
    const int64_t e = std::min(n, c + kChunk);
    int64_t i = c;
    for (; i + kLanes <= e; i += kLanes) store(y + i, gelu_tanh(load_tile(x + i)));
    for (; i < e; ++i) store1(y + i, gelu_tanh(widen(x[i])));
  }
}

// out [L, H, D] = x [L, H, D] (rows `stride` apart, heads D apart) with pair (2j, 2j + 1) of
// row l turned by the angle whose cos / sin are cs [l, j] / sn [l, j]
template <typename T>
void rope_rows(const T* x, int64_t stride, const float* cs, const float* sn, T* out, int64_t L,
               int64_t H, int64_t D) {
#pragma omp parallel for schedule(static) if (L * H * D >= kParallelMin)
  for (int64_t l = 0; l < L; ++l) {
    // per lane: a' = a c - b s at even lanes, b' = b c + a s at odd ones, i.e.
    // x * [c, c] + swap(x) * [-s, s]
    float c2[kMaxRope], s2[kMaxRope];
    for (int64_t j = 0; j < D / 2; ++j) {
      c2[2 * j] = c2[2 * j + 1] = cs[l * D / 2 + j];
      s2[2 * j] = -sn[l * D / 2 + j];
      s2[2 * j + 1] = sn[l * D / 2 + j];
    }
    for (int64_t h = 0; h < H; ++h) {
      const T* src = x + l * stride + h * D;
      T* dst = out + (l * H + h) * D;
      int64_t i = 0;
      for (; i + kLanes <= D; i += kLanes) {
        const vtile v = load_tile(src + i);
        const vtile sw = __builtin_shuffle(v, kSwapPairs);  // each lane's pair partner
        store(dst + i, v * load_tile(c2 + i) + sw * load_tile(s2 + i));
      }
      for (; i < D; ++i) store1(dst + i, widen(src[i]) * c2[i] + widen(src[i ^ 1]) * s2[i]);
    }
  }
}

}  // namespace

extern "C" {

void gelu_tanh_f32(const float* x, float* y, int64_t n) { gelu_rows(x, y, n); }
void gelu_tanh_bf16(const uint16_t* x, uint16_t* y, int64_t n) { gelu_rows(x, y, n); }

// D even and at most kMaxRope (the wrapper checks)
void rope_pairs_f32(const float* x, int64_t stride, const float* cs, const float* sn, float* out,
                    int64_t L, int64_t H, int64_t D) {
  rope_rows(x, stride, cs, sn, out, L, H, D);
}
void rope_pairs_bf16(const uint16_t* x, int64_t stride, const float* cs, const float* sn,
                     uint16_t* out, int64_t L, int64_t H, int64_t D) {
  rope_rows(x, stride, cs, sn, out, L, H, D);
}

}  // extern "C"
