// Routed experts with MXFP4 weights (kernels/ref/mxfp4.py: E2M1 codes two to a byte along
// the input, the low nibble the even element, one E8M0 scale per 32 inputs) against fp32
// activations: K3's experts as they ship, read at 0.53 bytes a parameter. Built into the
// kda_cpu library (build.py); `moe_experts_mxfp4`'s contract is `moe_experts_ref`'s with
// uint8 weights, tested against it (dequantize, then the products).
//
// A group of 32 weights is 16 bytes. Each byte's two codes go to two vectors (even and odd
// elements), looked up in registers (a 16-entry table: one permute per 16 codes on AVX-512;
// the 8 magnitudes and a sign bit on AVX2), multiplied by the token's x split the same way
// (even and odd elements, split once per call), and the group's sum is scaled once: two FMAs
// and one multiply-add per 32 weights and token, no widened copy of the weights. An expert's
// tokens go kStreamRows at a time over each block of 32 weight rows (in L2 after the first).
// An expert with kBlockedFrom tokens or more runs as token blocks on the broadcast tiles
// instead (expert_blocks.h, as bf16 experts do), each panel of 8 weight rows decoded to fp32
// once per block; on AMX hosts on the tiles (amx_cpu.cpp), from 32-row panels decoded to bf16
// (mxfp4_rows_bf16: exact).

#include <algorithm>
#include <array>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

extern "C" {
// amx_cpu.cpp
int64_t linear_amx_ready();
int64_t linear_amx_mxfp4w(const float* x, const uint8_t* codes, const uint8_t* scales, float* y,
                          int64_t M, int64_t N, int64_t K, int64_t team);
}

namespace {

#include "tiles.h"
#include "vmath.h"
#include "expert_order.h"
#include "gemm_blocks.h"
#include "expert_blocks.h"

constexpr int64_t kGroup = 32;
// From this many tokens an expert runs as token blocks: a prefill's experts (64 / 128 tokens
// of K3's shapes, 32-64 an expert) took 702 / 1,385 ms streamed four tokens at a time, against
// bf16 experts' 528 / 895 on the tiles (2-core Zen 4)
constexpr int64_t kBlockedFrom = 16;
constexpr int64_t kStreamRows = 4;  // tokens against each weight row at once (registers)
constexpr int64_t kRowBlock = 32;   // weight rows per task
constexpr float kE2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// 2^(s - 127) for every E8M0 code, exact: 0 is the subnormal 2^-127, 255 infinity (as
// compressed-tensors' decompression and the reference give)
struct ScaleTable {
  float v[256];
  ScaleTable() {
    for (int s = 0; s < 256; ++s) {
      const uint32_t bits = s == 0 ? 0x00400000u : static_cast<uint32_t>(s) << 23;
      std::memcpy(&v[s], &bits, 4);
    }
  }
};
const ScaleTable kScale;

// x [K] -> xs [K]: per group of 32, its 16 even elements then its 16 odd ones (the order
// the codes come out of a byte run)
inline void split_even_odd(const float* x, float* xs, int64_t K) {
  for (int64_t g = 0; g < K; g += kGroup)
    for (int64_t i = 0; i < kGroup / 2; ++i) {
      xs[g + i] = x[g + 2 * i];
      xs[g + kGroup / 2 + i] = x[g + 2 * i + 1];
    }
}

// y[m] (m < M <= kStreamRows) = the row (K / 2 bytes, K / 32 scales) . x_m, x split by
// split_even_odd
template <int M>
inline void dot_row(const uint8_t* __restrict w, const uint8_t* __restrict s,
                    const float* __restrict xs, int64_t K, float* y, int64_t ldy) {
  float total[M] = {};
#if defined(__AVX512F__)
  const __m512 table = _mm512_loadu_ps(kE2M1);
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < K / kGroup; ++g) {
    __builtin_prefetch(w + g * 16 + 512, 0, 3);
    const __m512i v = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + g * 16)));
    const __m512 even = _mm512_permutexvar_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)), table);
    const __m512 odd = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
    const __m512 scale = _mm512_set1_ps(kScale.v[s[g]]);
    for (int m = 0; m < M; ++m) {
      const float* xg = xs + m * K + g * kGroup;
      const __m512 part = _mm512_fmadd_ps(odd, _mm512_loadu_ps(xg + 16),
                                          _mm512_mul_ps(even, _mm512_loadu_ps(xg)));
      acc[m] = _mm512_fmadd_ps(part, scale, acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) total[m] = _mm512_reduce_add_ps(acc[m]);
#elif defined(__AVX2__)
  const __m256 mags = _mm256_loadu_ps(kE2M1);
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  const auto lookup = [&](__m256i c) {  // 8 codes: magnitude by permute, then the sign bit
    const __m256 mag = _mm256_permutevar8x32_ps(mags, _mm256_and_si256(c, _mm256_set1_epi32(7)));
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(8)), 28);
    return _mm256_xor_ps(mag, _mm256_castsi256_ps(sign));
  };
  for (int64_t g = 0; g < K / kGroup; ++g) {
    __builtin_prefetch(w + g * 16 + 512, 0, 3);
    const __m256 scale = _mm256_set1_ps(kScale.v[s[g]]);
    for (int half = 0; half < 2; ++half) {  // bytes 0-7: elements 0-15; 8-15: 16-31
      const __m256i v = _mm256_cvtepu8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + g * 16 + half * 8)));
      const __m256 even = lookup(v), odd = lookup(_mm256_srli_epi32(v, 4));
      for (int m = 0; m < M; ++m) {
        const float* xg = xs + m * K + g * kGroup + half * 8;
        const __m256 part = _mm256_fmadd_ps(odd, _mm256_loadu_ps(xg + 16),
                                            _mm256_mul_ps(even, _mm256_loadu_ps(xg)));
        acc[m] = _mm256_fmadd_ps(part, scale, acc[m]);
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc[m]);
    for (float l : lanes) total[m] += l;
  }
#else
  for (int64_t g = 0; g < K / kGroup; ++g)
    for (int m = 0; m < M; ++m) {
      float part = 0.0f;
      for (int64_t i = 0; i < kGroup / 2; ++i) {
        const uint8_t b = w[g * 16 + i];
        part += kE2M1[b & 15] * xs[m * K + g * kGroup + i] +
                kE2M1[b >> 4] * xs[m * K + g * kGroup + 16 + i];
      }
      total[m] += part * kScale.v[s[g]];
    }
#endif
  for (int m = 0; m < M; ++m) y[m * ldy] = total[m];
}

#if defined(KDASERVE_BF16_DOTS)
// The BF16 dots (where the build asks for them, gemm_blocks.h): a pair of groups' 32 bytes
// widened to 16-bit lanes and looked up as bf16 (E2M1 values are exact there) with one
// permute per 32 codes, then VDPBF16PS against x split into two bf16 parts (hi + lo: 16 of
// fp32's 24 mantissa bits, an error near 2^-17 of the row's magnitude). A standalone loop at
// K3's gate/up rows from memory, 2 threads on Zen 4: 1.28-1.36x the fp32 lookups above.
// xb: per 64 inputs (groups A, B), [even hi 32][even lo 32][odd hi 32][odd lo 32], lanes
// 0-15 group A's, 16-31 group B's, from split_even_odd's order.
inline void split_pairs(const float* xs, int64_t K, bf16* xb) {
  float even[32], odd[32];
  for (int64_t g = 0; g < K; g += 2 * kGroup, xb += 128) {
    std::copy(xs + g, xs + g + 16, even);
    std::copy(xs + g + 32, xs + g + 48, even + 16);
    std::copy(xs + g + 16, xs + g + 32, odd);
    std::copy(xs + g + 48, xs + g + 64, odd + 16);
    split_bf16(even, 32, xb, xb + 32);
    split_bf16(odd, 32, xb + 64, xb + 96);
  }
}

// kE2M1 as bf16 bits, twice (vpermw's table has 32 entries), built once
struct E2M1Bf16 {
  alignas(64) bf16 v[32];
  E2M1Bf16() {
    for (int i = 0; i < 32; ++i) {
      uint32_t bits;
      std::memcpy(&bits, &kE2M1[i & 15], 4);
      v[i] = static_cast<bf16>(bits >> 16);
    }
  }
};
const E2M1Bf16 kE2M1Bf16;

template <int M>
inline void dot_row_bf16(const uint8_t* __restrict w, const uint8_t* __restrict s,
                         const bf16* __restrict xb, int64_t K, float* y, int64_t ldy) {
  const __m512i table = _mm512_load_si512(kE2M1Bf16.v);
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K / (2 * kGroup); ++p) {
    __builtin_prefetch(w + p * 32 + 512, 0, 3);
    const __m512i v = _mm512_cvtepu8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32)));
    const __m512bh even = (__m512bh)_mm512_permutexvar_epi16(
        _mm512_and_si512(v, _mm512_set1_epi16(15)), table);
    const __m512bh odd = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table);
    const __m512 scale = _mm512_insertf32x8(_mm512_set1_ps(kScale.v[s[2 * p]]),
                                            _mm256_set1_ps(kScale.v[s[2 * p + 1]]), 1);
    for (int m = 0; m < M; ++m) {
      const bf16* x = xb + m * 2 * K + p * 128;
      __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), even, (__m512bh)_mm512_loadu_si512(x));
      t = _mm512_dpbf16_ps(t, even, (__m512bh)_mm512_loadu_si512(x + 32));
      t = _mm512_dpbf16_ps(t, odd, (__m512bh)_mm512_loadu_si512(x + 64));
      t = _mm512_dpbf16_ps(t, odd, (__m512bh)_mm512_loadu_si512(x + 96));
      acc[m] = _mm512_fmadd_ps(t, scale, acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) y[m * ldy] = _mm512_reduce_add_ps(acc[m]);
}
#endif

// Whether the rows of a weight with K inputs take the BF16 dots (then x is also given as
// split_pairs' layout)
constexpr bool pairs_for(int64_t K) {
#if defined(KDASERVE_BF16_DOTS)
  return K % (2 * kGroup) == 0;
#else
  return K < 0;
#endif
}

// rows [r0, r1) of a weight [N, K] (packed w, scales s) against M split x rows (xb: the same
// in split_pairs' layout, where pairs_for(K))
inline void stream_rows_mxfp4(const uint8_t* w, const uint8_t* s, const float* xs,
                              const bf16* xb, int64_t M, int64_t K, float* y, int64_t ldy,
                              int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* wr = w + r * (K / 2);
    const uint8_t* sr = s + r * (K / kGroup);
#if defined(KDASERVE_BF16_DOTS)
    if (xb != nullptr) {
      switch (M) {
        case 1: dot_row_bf16<1>(wr, sr, xb, K, y + r, ldy); break;
        case 2: dot_row_bf16<2>(wr, sr, xb, K, y + r, ldy); break;
        case 3: dot_row_bf16<3>(wr, sr, xb, K, y + r, ldy); break;
        default: dot_row_bf16<4>(wr, sr, xb, K, y + r, ldy); break;
      }
      continue;
    }
#endif
    switch (M) {
      case 1: dot_row<1>(wr, sr, xs, K, y + r, ldy); break;
      case 2: dot_row<2>(wr, sr, xs, K, y + r, ldy); break;
      case 3: dot_row<3>(wr, sr, xs, K, y + r, ldy); break;
      default: dot_row<4>(wr, sr, xs, K, y + r, ldy); break;
    }
  }
}

// One weight's rows [r0, r1) for an expert's M tokens, x split by split_even_odd: up to
// kStreamRows tokens at a time against each row, the block's rows (61 KB at K3's 3,584
// inputs and 32 rows) re-read from L2 by the next tokens. (Widening the block to fp32 once
// and running plain dots on it was 3.4x slower at 8 tokens an expert: the widening is
// scalar, and the dots read 8x the bytes.)
inline void expert_rows(const uint8_t* w, const uint8_t* s, const float* xs, const bf16* xb,
                        int64_t M, int64_t K, float* y, int64_t ldy, int64_t r0, int64_t r1) {
  for (int64_t m0 = 0; m0 < M; m0 += kStreamRows)
    stream_rows_mxfp4(w, s, xs + m0 * K, xb ? xb + m0 * 2 * K : nullptr,
                      std::min(kStreamRows, M - m0), K, y + m0 * ldy, ldy, r0, r1);
}

// One group's 16 bytes as its 32 values in order: the even elements (low nibbles) and the odd
// ones (high) interleaved back, each its E2M1 magnitude times the group's scale, exact in fp32.
inline void decode_group(const uint8_t* codes, float scale, float* out) {
#if defined(__AVX512F__)
  const __m512 table = _mm512_loadu_ps(kE2M1), sc = _mm512_set1_ps(scale);
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  const __m512 even = _mm512_permutexvar_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)), table);
  const __m512 odd = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
  const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_permutex2var_ps(even, first, odd), sc));
  _mm512_storeu_ps(out + 16, _mm512_mul_ps(_mm512_permutex2var_ps(even, second, odd), sc));
#else
  for (int64_t j = 0; j < kGroup / 2; ++j) {
    out[2 * j] = kE2M1[codes[j] & 15] * scale;
    out[2 * j + 1] = kE2M1[codes[j] >> 4] * scale;
  }
#endif
}

// Rows [p, p + tn) of an MXFP4 weight [N, K] (codes w, scales s) decoded into wide [tn, K].
inline void decode_rows(const uint8_t* w, const uint8_t* s, int64_t p, int64_t tn, int64_t K,
                        float* wide) {
  for (int64_t i = 0; i < tn; ++i)
    for (int64_t g = 0; g < K / kGroup; ++g)
      decode_group(w + (p + i) * (K / 2) + g * 16, kScale.v[s[(p + i) * (K / kGroup) + g]],
                   wide + i * K + g * kGroup);
}

// Tokens [s0, s1) of expert e (sorted order; order[s] / k is the token) into ys rows s0..s1,
// weighted: expert_block's path for float weights (moe_cpu.cpp), with each panel of weight
// rows decoded from MXFP4 into the scratch's `wide` panel before its tiles run.
void mxfp4_block(const float* x, const int64_t* order, const float* weights, const uint8_t* w13,
                 const uint8_t* s13, const uint8_t* w2, const uint8_t* s2, float* ys, int64_t e,
                 int64_t s0, int64_t s1, int64_t k, int64_t I, int64_t D, BlockScratch& b,
                 const Glu& act) {
  const uint8_t *c13 = w13 + e * 2 * I * (D / 2), *g13 = s13 + e * 2 * I * (D / kGroup);
  const uint8_t *c2 = w2 + e * D * (I / 2), *g2 = s2 + e * D * (I / kGroup);
  const int64_t M = s1 - s0, Mp = round_up(M, kLanes);
  if (linear_amx_ready() == 1) {  // bf16 panels decoded exactly on the tiles' way in
    amx_block(x, order, weights, ys, s0, s1, k, I, D, b, act,
              [&](const float* xr, float* hr) {
                linear_amx_mxfp4w(xr, c13, g13, hr, M, 2 * I, D, 0);
              },
              [&](const float* ar, float* yr) { linear_amx_mxfp4w(ar, c2, g2, yr, M, D, I, 0); });
    return;
  }
  float *xt = b.xt.get(), *ht = b.ht.get(), *at = b.at.get(), *yt = b.yt.get();
  float* wide = b.wide.get();
  int32_t row[kBlockRows];  // the block's tokens' x rows, as offsets from x
  for (int64_t m = 0; m < M; ++m) row[m] = static_cast<int32_t>((order[s0 + m] / k) * D);
  gather_t(x, row, M, Mp, D, xt);
  bcast_panels([&](int64_t p, int64_t tn) {
    decode_rows(c13, g13, p, tn, D, wide);
    return static_cast<const float*>(wide);
  }, 2 * I, D, xt, Mp, Mp, ht, false);
  glu_row(act, ht, ht + I * Mp, at, I * Mp);  // zero padding stays zero: act(0) * 0
  bcast_panels([&](int64_t p, int64_t tn) {
    decode_rows(c2, g2, p, tn, I, wide);
    return static_cast<const float*>(wide);
  }, D, I, at, Mp, Mp, yt, false);
  float wt[kBlockRows];
  for (int64_t m = 0; m < M; ++m) wt[m] = weights[order[s0 + m]];
  scatter_t(yt, M, Mp, D, nullptr, wt, ys + s0 * D);
}

}  // namespace

extern "C" {

// Rows [p, p + tn) of an MXFP4 weight [N, K] as bf16 into out (row stride ldo >= K): exact,
// as an E2M1 value times a power of two has at most two significant bits, so the fp32
// decode's low 16 bits are zero (infinity stays infinity). AMX's panels (amx_cpu.cpp) come
// from here; tested against the reference's decode on every host.
void mxfp4_rows_bf16(const uint8_t* w, const uint8_t* s, int64_t p, int64_t tn, int64_t K,
                     uint16_t* out, int64_t ldo) {
  alignas(64) float group[kGroup];
  for (int64_t i = 0; i < tn; ++i)
    for (int64_t g = 0; g < K / kGroup; ++g) {
      decode_group(w + (p + i) * (K / 2) + g * 16, kScale.v[s[(p + i) * (K / kGroup) + g]],
                   group);
      uint16_t* dst = out + i * ldo + g * kGroup;
      for (int64_t j = 0; j < kGroup; ++j) {
        uint32_t bits;
        std::memcpy(&bits, &group[j], 4);
        dst[j] = static_cast<uint16_t>(bits >> 16);
      }
    }
}

// `moe_experts_ref`'s contract with MXFP4 experts: x [T, D]; ids, weights [T, k];
// w13 [E, 2I, D / 2] and s13 [E, 2I, D / 32]; w2 [E, D, I / 2] and s2 [E, D, I / 32];
// out [T, D]. beta, linear_beta: SwiGLU (beta 0) or K3's SiTU-GLU (glu_row, vmath.h). The
// weighted sum over a token's experts is fp32.
void moe_experts_mxfp4(const float* x, const int64_t* ids, const float* weights,
                       const uint8_t* w13, const uint8_t* s13, const uint8_t* w2,
                       const uint8_t* s2, float* out, int64_t T, int64_t k, int64_t E,
                       int64_t I, int64_t D, float beta, float linear_beta) {
  const int64_t n = T * k;
  const ExpertOrder sorted(ids, n, E);
  const std::vector<int64_t>&offset = sorted.offset, &order = sorted.order;
  const int64_t blocked_from = T * D > INT32_MAX ? INT64_MAX : kBlockedFrom;  // gather_t's rows
  const ExpertPlan plan(offset, E, blocked_from);
  const std::vector<int64_t>& active = plan.small;  // streamed experts
  std::vector<int64_t> pairs;  // the streamed experts' pairs (sorted rows)
  for (int64_t e : active)
    for (int64_t p = offset[e]; p < offset[e + 1]; ++p) pairs.push_back(p);
  const int64_t A = static_cast<int64_t>(active.size());
  const int64_t P = static_cast<int64_t>(pairs.size());
  // rows in sorted order (an expert's tokens are consecutive); the split copies and h / act
  // are the streamed experts' only
  std::unique_ptr<float[]> xsplit(new float[n * D]),
      h(new float[n * 2 * I]), act(new float[n * I]), asplit(new float[n * I]),
      ys(new float[n * D]);
  // the same in split_pairs' layout, for weights that take the BF16 dots (2 values a row)
  std::unique_ptr<bf16[]> xpairs(pairs_for(D) ? new bf16[n * 2 * D] : nullptr),
      apairs(pairs_for(I) ? new bf16[n * 2 * I] : nullptr);
#pragma omp parallel for schedule(static) if (P * D >= (int64_t{1} << 16))
  for (int64_t j = 0; j < P; ++j) {
    const int64_t p = pairs[j];
    split_even_odd(x + (order[p] / k) * D, xsplit.get() + p * D, D);
#if defined(KDASERVE_BF16_DOTS)
    if (xpairs) split_pairs(xsplit.get() + p * D, D, xpairs.get() + p * 2 * D);
#endif
  }
  const Glu glu{beta, linear_beta};
  const int64_t iblocks = (I + kRowBlock - 1) / kRowBlock;
  const int64_t dblocks = (D + kRowBlock - 1) / kRowBlock;
#pragma omp parallel
  {
    run_blocks(plan, I, D, [&](const std::array<int64_t, 3>& b, BlockScratch& scratch) {
      mxfp4_block(x, order.data(), weights, w13, s13, w2, s2, ys.get(), b[0], b[1], b[2], k, I,
                  D, scratch, glu);
    });
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < A * iblocks; ++task) {
      const int64_t e = active[task / iblocks], r0 = (task % iblocks) * kRowBlock;
      const int64_t r1 = std::min(I, r0 + kRowBlock), p0 = offset[e], M = offset[e + 1] - p0;
      const uint8_t* we = w13 + e * 2 * I * (D / 2);
      const uint8_t* se = s13 + e * 2 * I * (D / kGroup);
      float* he = h.get() + p0 * 2 * I;
      const float* xse = xsplit.get() + p0 * D;
      const bf16* xbe = xpairs ? xpairs.get() + p0 * 2 * D : nullptr;
      expert_rows(we, se, xse, xbe, M, D, he, 2 * I, r0, r1);           // gate rows
      expert_rows(we, se, xse, xbe, M, D, he, 2 * I, I + r0, I + r1);   // up rows
      for (int64_t m = 0; m < M; ++m) {
        float* am = act.get() + (p0 + m) * I;
        glu_row(glu, he + m * 2 * I + r0, he + m * 2 * I + I + r0, am + r0, r1 - r0);
      }
    }
    // the down projection's inputs split once each (whole rows: after every gate task)
#pragma omp for schedule(static)
    for (int64_t j = 0; j < P; ++j) {
      split_even_odd(act.get() + pairs[j] * I, asplit.get() + pairs[j] * I, I);
#if defined(KDASERVE_BF16_DOTS)
      if (apairs) split_pairs(asplit.get() + pairs[j] * I, I, apairs.get() + pairs[j] * 2 * I);
#endif
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < A * dblocks; ++task) {
      const int64_t e = active[task / dblocks], d0 = (task % dblocks) * kRowBlock;
      const int64_t d1 = std::min(D, d0 + kRowBlock), p0 = offset[e], M = offset[e + 1] - p0;
      expert_rows(w2 + e * D * (I / 2), s2 + e * D * (I / kGroup), asplit.get() + p0 * I,
                  apairs ? apairs.get() + p0 * 2 * I : nullptr, M, I, ys.get() + p0 * D, D, d0,
                  d1);
      for (int64_t m = 0; m < M; ++m) {
        const float wt = weights[order[p0 + m]];
        for (int64_t d = d0; d < d1; ++d) ys[(p0 + m) * D + d] *= wt;
      }
    }
    sum_choices(ys.get(), sorted.slot.data(), out, T, k, D);
  }
}

}  // extern "C"
