// The vision tower's attention in bf16: every patch of an image attends to every other (no
// mask, no cache), q, k, v and the output bf16, scores, softmax and sums fp32. Built into the
// kda_cpu library (build.py) and tested against fp32 attention of the same bf16 inputs
// (tests/kernels/test_native_vision.py); kernels/native/vision.py calls it.
//
// Why our own: torch's fused CPU kernel runs bf16 no faster than fp32 (175 against 172
// GFLOP/s at 1,024 patches, 12 heads of 128, on a 2-core Zen 4 whose bf16 GEMM reaches 390),
// so the 17% of a 448-pixel image's FLOPs in attention took a third of the tower's time. Here
// both products run on the BF16 dot instruction (VDPBF16PS: 32 bf16 pairs into 16 fp32 sums),
// which takes its operands in pairs along the summed axis:
// - scores S = q k^T sum over the head dim, so k is packed as [32-key tile][d / 2][32 keys][2]
//   and a query's pair (q[2p], q[2p+1]) is broadcast: one vector of 16 keys' sums per dot;
// - the output O = P v sums over keys, so v is packed as [key pair][d][2] and a query's two
//   probabilities (P[2t], P[2t+1]) are broadcast: one vector of 16 output columns per dot.
// A task is one head and 48 queries; it walks the keys in blocks of 512 with the online
// softmax (running max and sum per query, the output rescaled when the max grows), so its
// scores, probabilities and output stay in L2 whatever the image's size. The probabilities are
// rounded to bf16 for the second product, as GPU flash attention does.
// Without AVX512-BF16 (or where the build does not ask for BF16 dots: on Intel's Sapphire
// Rapids they ran slower than widening, gemm_blocks.h) image_attention_ready() is 0 and the
// tower keeps torch's kernel.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <vector>

#include <omp.h>

namespace {

#include "tiles.h"
#include "vmath.h"

#if defined(__AVX512BF16__) && defined(KDASERVE_WANT_BF16_DOTS)
#define KDASERVE_IMAGE_ATTENTION 1

constexpr int kRows = 12;                   // queries per register tile (24 of 32 registers)
constexpr int64_t kQueries = 4 * kRows;     // queries per task
constexpr int64_t kKeyTile = 32;            // keys per score tile: two 16-lane vectors
constexpr int64_t kKeyBlock = 16 * kKeyTile;  // keys per softmax block

inline __m512bh pair_of(const bf16* p) {  // two bf16 values in every 32-bit lane
  int32_t u;
  std::memcpy(&u, p, sizeof(u));
  return (__m512bh)_mm512_set1_epi32(u);
}

// s [R][32] (row stride ld) = q [R][D] . the packed key tile kt [D / 2][32][2]
template <int R>
inline void score_tile(const bf16* q, int64_t D, const bf16* kt, float* s, int64_t ld) {
  __m512 acc[R][2];
  for (auto& a : acc) a[0] = a[1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < D / 2; ++p) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + p * 64);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt + p * 64 + 32);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = pair_of(q + r * D + 2 * p);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, k0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, k1);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(s + r * ld, acc[r][0]);
    _mm512_storeu_ps(s + r * ld + 16, acc[r][1]);
  }
}

// o [R][c0, c0 + 32) (row stride D) += P [R][2 * pairs] (row stride ld) . packed values
// vp [pairs][D][2]
template <int R>
inline void value_tile(const bf16* P, int64_t ld, int64_t pairs, const bf16* vp, int64_t D,
                       int64_t c0, float* o) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) {
    acc[r][0] = _mm512_loadu_ps(o + r * D + c0);
    acc[r][1] = _mm512_loadu_ps(o + r * D + c0 + 16);
  }
  for (int64_t t = 0; t < pairs; ++t) {
    const bf16* row = vp + t * 2 * D + 2 * c0;
    const __m512bh v0 = (__m512bh)_mm512_loadu_si512(row);
    const __m512bh v1 = (__m512bh)_mm512_loadu_si512(row + 32);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = pair_of(P + r * ld + 2 * t);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, v0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, v1);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(o + r * D + c0, acc[r][0]);
    _mm512_storeu_ps(o + r * D + c0 + 16, acc[r][1]);
  }
}

// One task's working set: its queries, scores, probabilities and output, and each query's
// running max and sum.
struct Scratch {
  std::vector<bf16> q, P;
  std::vector<float> s, o, m, l;
  Scratch(int64_t D)
      : q(kQueries * D), P(kQueries * kKeyBlock), s(kQueries * kKeyBlock), o(kQueries * D),
        m(kQueries), l(kQueries) {}
};

struct Shape {
  int64_t L, H, D, tiles;  // patches, heads, head dim, 32-key tiles
  float scale;
};

// Queries [q0, q0 + kQueries) of head h: the online softmax over blocks of keys.
void attend_block(const Shape& sh, const bf16* q, int64_t q_stride, const bf16* kp,
                  const bf16* vp, bf16* out, int64_t out_stride, int64_t h, int64_t q0,
                  Scratch& w) {
  const int64_t D = sh.D, n = std::min(kQueries, sh.L - q0);
  const int64_t rows = (n + kRows - 1) / kRows * kRows;  // whole tiles; the rest zero
  std::fill(w.q.begin(), w.q.end(), bf16(0));
  for (int64_t r = 0; r < n; ++r)
    std::memcpy(w.q.data() + r * D, q + (q0 + r) * q_stride + h * D, D * sizeof(bf16));
  std::fill(w.o.begin(), w.o.end(), 0.0f);
  std::fill(w.m.begin(), w.m.end(), -INFINITY);
  std::fill(w.l.begin(), w.l.end(), 0.0f);
  for (int64_t k0 = 0; k0 < sh.L; k0 += kKeyBlock) {
    const int64_t keys = std::min(kKeyBlock, sh.tiles * kKeyTile - k0);  // whole tiles
    const int64_t valid = std::min(kKeyBlock, sh.L - k0);
    for (int64_t j = 0; j < keys; j += kKeyTile)
      for (int64_t r = 0; r < rows; r += kRows)
        score_tile<kRows>(w.q.data() + r * D, D, kp + (k0 + j) * D, w.s.data() + r * kKeyBlock + j,
                          kKeyBlock);
    for (int64_t r = 0; r < rows; ++r) {
      float* s = w.s.data() + r * kKeyBlock;
      for (int64_t j = valid; j < keys; ++j) s[j] = -INFINITY;  // the last tile's padding
      vtile mv = splat(-INFINITY);
      for (int64_t j = 0; j < keys; j += kLanes) mv = mv > load_tile(s + j) ? mv : load_tile(s + j);
      const float mx = std::max(w.m[r], _mm512_reduce_max_ps(mv));
      const float corr = std::exp((w.m[r] - mx) * sh.scale);  // 0 at the first block
      vtile sum = {};
      bf16* P = w.P.data() + r * kKeyBlock;
      for (int64_t j = 0; j < keys; j += kLanes) {
        const vtile p = vexp((load_tile(s + j) - mx) * sh.scale);
        sum += p;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(P + j), (__m256i)_mm512_cvtneps_pbh(p));
      }
      w.l[r] = w.l[r] * corr + _mm512_reduce_add_ps(sum);
      w.m[r] = mx;
      if (corr != 1.0f)
        for (int64_t c = 0; c < D; ++c) w.o[r * D + c] *= corr;
    }
    for (int64_t r = 0; r < rows; r += kRows)
      for (int64_t c0 = 0; c0 < D; c0 += 32)
        value_tile<kRows>(w.P.data() + r * kKeyBlock, kKeyBlock, keys / 2, vp + k0 * D, D, c0,
                          w.o.data() + r * D);
  }
  for (int64_t r = 0; r < n; ++r) {
    const vtile inv = splat(1.0f / w.l[r]);
    bf16* dst = out + (q0 + r) * out_stride + h * D;
    for (int64_t c = 0; c < D; c += kLanes)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c),
                          (__m256i)_mm512_cvtneps_pbh(load_tile(w.o.data() + r * D + c) * inv));
  }
}

#endif

}  // namespace

extern "C" {

int64_t image_attention_ready() {
#if defined(KDASERVE_IMAGE_ATTENTION)
  return 1;
#else
  return 0;
#endif
}

// o [L, H, D] = softmax(scale q k^T) v per head, all bf16, rows of q, k, v, o `*_stride`
// elements apart with the heads contiguous in a row; D a multiple of 32. Returns 0 (and does
// nothing) where the build has no BF16 dots.
int64_t image_attention_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* k,
                             int64_t k_stride, const uint16_t* v, int64_t v_stride, uint16_t* o,
                             int64_t o_stride, int64_t L, int64_t H, int64_t D, float scale) {
#if defined(KDASERVE_IMAGE_ATTENTION)
  const Shape sh{L, H, D, (L + kKeyTile - 1) / kKeyTile, scale};
  const int64_t padded = sh.tiles * kKeyTile;
  // per head: keys [tile][D / 2][32][2], values [key pair][D][2], the padding zero
  std::vector<bf16> kp(H * padded * D), vp(H * padded * D);
#pragma omp parallel for schedule(static)
  for (int64_t task = 0; task < H * sh.tiles; ++task) {
    const int64_t h = task / sh.tiles, t = task % sh.tiles;
    bf16* kt = kp.data() + (h * padded + t * kKeyTile) * D;
    bf16* vt = vp.data() + (h * padded + t * kKeyTile) * D;
    for (int64_t j = 0; j < kKeyTile; ++j) {
      const int64_t key = t * kKeyTile + j;
      const bf16* kr = key < L ? k + key * k_stride + h * D : nullptr;
      const bf16* vr = key < L ? v + key * v_stride + h * D : nullptr;
      for (int64_t p = 0; p < D / 2; ++p) {
        kt[(p * kKeyTile + j) * 2] = kr ? kr[2 * p] : 0;
        kt[(p * kKeyTile + j) * 2 + 1] = kr ? kr[2 * p + 1] : 0;
      }
      for (int64_t c = 0; c < D; ++c) vt[((j / 2) * D + c) * 2 + j % 2] = vr ? vr[c] : 0;
    }
  }
  const int64_t blocks = (L + kQueries - 1) / kQueries;
#pragma omp parallel
  {
    Scratch w(D);
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < H * blocks; ++task) {
      const int64_t h = task / blocks;
      attend_block(sh, q, q_stride, kp.data() + h * padded * D, vp.data() + h * padded * D, o,
                   o_stride, h, task % blocks * kQueries, w);
    }
  }
  return 1;
#else
  (void)q, (void)q_stride, (void)k, (void)k_stride, (void)v, (void)v_stride, (void)o;
  (void)o_stride, (void)L, (void)H, (void)D, (void)scale;
  return 0;
#endif
}

}  // extern "C"
