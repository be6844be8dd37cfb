// bf16 weights at many rows (prefill, batched decode) on AMX tiles, where the host has them
// (Intel Sapphire Rapids and later). The other paths widen bf16 weights to fp32 (in registers,
// or a whole copy for oneDNN), so a bf16 model's GEMMs ran no faster than fp32's; a tile
// multiply (TDPBF16PS, 16 x 16 outputs x 32 pairs) does 16x the products of an AVX-512 FMA.
// Its activations must be bf16 too, and rounding them (as GPU bf16 serving and llama.cpp do)
// would put a 2^-9 relative error on every product. So each activation is split into two bf16
// parts, hi = bf16(x) and lo = bf16(x - hi), and both are multiplied: hi + lo holds 16 of x's
// 24 mantissa bits (error <= 2^-17 |x|), products and sums stay fp32 in the tiles. That error
// is ~1/256 of what the bf16 weights themselves already carry, at twice the tile work.
// Built into the kda_cpu library (build.py); tested against fp32 arithmetic on the same bf16
// weights (tests/kernels/test_native_amx.py). Without AMX the entry points report it
// (linear_amx_ready() == 0) and ops.py never calls the product.

#include <algorithm>
#include <cstdint>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <memory>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__linux__)
#define KDASERVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

typedef uint16_t bf16;

#if defined(KDASERVE_AMX)

// Linux keeps the 8 KB tile state off until a process asks (arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA); a tile instruction before that faults.
bool granted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// Every tile 16 rows of 64 bytes: tmm0-3 the 2 x 2 fp32 outputs, tmm4-5 weight rows (16 rows x
// 32 k), tmm6-7 activation pairs (16 k-pairs x 16 columns, the VNNI layout TDPBF16PS reads).
struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

void configure() {
  TileConfig c;
  std::memset(&c, 0, sizeof(c));
  c.palette = 1;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

constexpr int64_t kChunk = 32;   // k values in one tile row
constexpr int64_t kPanel = 32;   // weight rows per task (two A tiles)
constexpr int64_t kCols = 32;    // activation columns per output block (two B tiles)
constexpr int64_t kTile = 256;   // dwords in a tile

inline uint32_t pair(bf16 a, bf16 b) { return static_cast<uint32_t>(a) | static_cast<uint32_t>(b) << 16; }

inline bf16 to_bf16(float x) {  // round to nearest even (as VCVTNEPS2BF16)
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<bf16>(u >> 16);
}

inline float widen(bf16 h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// x [M, K] -> B tiles: activation column j = 2m + part (hi, lo), tile (jb, kc) holds columns
// [16 jb, 16 jb + 16) over k in [32 kc, 32 kc + 32): dword (kk, c) = the column's values at
// k = 32 kc + 2 kk and the next one. xb is zeroed beforehand (padding rows and k).
void pack_split(const float* x, int64_t M, int64_t K, int64_t nkc, uint32_t* xb) {
#pragma omp parallel for schedule(static)
  for (int64_t m = 0; m < M; ++m) {
    alignas(64) bf16 hi[16], lo[16];
    for (int64_t k0 = 0; k0 < K; k0 += 16) {
      const int64_t n = std::min<int64_t>(16, K - k0);
      if (n == 16) {
        const __m512 v = _mm512_loadu_ps(x + m * K + k0);
        const __m256bh h = _mm512_cvtneps_pbh(v);
        std::memcpy(hi, &h, sizeof(hi));
        const __m512 hw = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_load_si256(
                                  reinterpret_cast<const __m256i*>(hi))), 16));
        const __m256bh l = _mm512_cvtneps_pbh(_mm512_sub_ps(v, hw));
        std::memcpy(lo, &l, sizeof(lo));
      } else {
        for (int64_t i = 0; i < 16; ++i) {
          const float v = i < n ? x[m * K + k0 + i] : 0.0f;
          hi[i] = to_bf16(v);
          lo[i] = to_bf16(v - widen(hi[i]));
        }
      }
      for (int64_t i = 0; i < 16; i += 2) {
        const int64_t k = k0 + i, kc = k / kChunk, kk = (k % kChunk) / 2;
        for (int part = 0; part < 2; ++part) {
          const int64_t j = 2 * m + part, jb = j / 16, c = j % 16;
          const bf16* v = part == 0 ? hi : lo;
          xb[(jb * nkc + kc) * kTile + kk * 16 + c] = pair(v[i], v[i + 1]);
        }
      }
    }
  }
}

// The 32 x 32 outputs of one panel of 32 weight rows (a, stride lda) against the 32 split
// activation columns of B tiles b0 (columns 0-15) and b1 (16-31) over nkc chunks of k,
// added pairwise (hi + lo) into y rows m0 .. m1 (at most 16), columns n0 .. n0 + rows.
inline void panel_block(const bf16* a, int64_t lda, const uint32_t* b0, const uint32_t* b1,
                        int64_t nkc, float* ct, float* y, int64_t N, int64_t n0, int64_t rows,
                        int64_t m0, int64_t m1) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kc = 0; kc < nkc; ++kc) {
    _tile_loadd(4, a + kc * kChunk, lda * sizeof(bf16));
    _tile_loadd(5, a + 16 * lda + kc * kChunk, lda * sizeof(bf16));
    _tile_loadd(6, b0 + kc * kTile, 64);
    _tile_loadd(7, b1 + kc * kTile, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  // ct[n][j]: panel row n (of 32), block column j (of 32)
  _tile_stored(0, ct, kCols * sizeof(float));
  _tile_stored(1, ct + 16, kCols * sizeof(float));
  _tile_stored(2, ct + 16 * kCols, kCols * sizeof(float));
  _tile_stored(3, ct + 16 * kCols + 16, kCols * sizeof(float));
  for (int64_t m = m0; m < m1; ++m) {
    const int64_t j = 2 * (m - m0);
    for (int64_t n = 0; n < rows; ++n)
      y[m * N + n0 + n] = ct[n * kCols + j] + ct[n * kCols + j + 1];
  }
}

// Activation columns per pass over the weights: their B tiles (256 columns x 768 k: 384 KB)
// stay in L2 while every panel passes over them. Without the passes a 2,048-row product read
// all 6 MB of B tiles from L3 for each panel.
constexpr int64_t kPassCols = 256;

// y [M, N] = x [M, K] w [N, K]^T, w bf16: tasks are panels of 32 weight rows, each against
// every 32-column block of split activations (16 rows of x) of the pass.
void linear_amx(const float* x, const bf16* w, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t Kp = (K + kChunk - 1) / kChunk * kChunk, nkc = Kp / kChunk;
  const int64_t Jp = (2 * M + kCols - 1) / kCols * kCols, njb = Jp / 16;
  std::unique_ptr<uint32_t[]> xb(new uint32_t[njb * nkc * kTile]());
  pack_split(x, M, K, nkc, xb.get());
  const int64_t panels = (N + kPanel - 1) / kPanel;
#pragma omp parallel
  {
    configure();
    alignas(64) float ct[kPanel * kCols];
    // a panel past N's end or with K not a whole number of chunks, copied zero-padded (a tile
    // row must not read past the weight, and bf16 garbage may be NaN, which 0 would not cancel)
    std::unique_ptr<bf16[]> pad;
    for (int64_t j0 = 0; j0 < Jp; j0 += kPassCols) {
      const int64_t j1 = std::min(Jp, j0 + kPassCols);
#pragma omp for schedule(static) nowait
      for (int64_t p = 0; p < panels; ++p) {
        const int64_t n0 = p * kPanel, rows = std::min(kPanel, N - n0);
        const bf16* a = w + n0 * K;
        int64_t lda = K;
        if (rows < kPanel || Kp != K) {
          if (!pad) pad.reset(new bf16[kPanel * Kp]);
          std::fill(pad.get(), pad.get() + kPanel * Kp, 0);
          for (int64_t r = 0; r < rows; ++r)
            std::copy(a + r * K, a + (r + 1) * K, pad.get() + r * Kp);
          a = pad.get();
          lda = Kp;
        }
        for (int64_t j = j0; j < j1; j += kCols) {
          const uint32_t* b0 = xb.get() + (j / 16) * nkc * kTile;
          const int64_t m0 = j / 2;
          panel_block(a, lda, b0, b0 + nkc * kTile, nkc, ct, y, N, n0, rows, m0,
                      std::min(M, m0 + kCols / 2));
        }
      }
    }
    _tile_release();
  }
}

#endif  // KDASERVE_AMX

}  // namespace

extern "C" {

// 1 if this build has the AMX product and the kernel let the process use the tiles.
int64_t linear_amx_ready() {
#if defined(KDASERVE_AMX)
  return granted() ? 1 : 0;
#else
  return 0;
#endif
}

// y [M, N] = x [M, K] (fp32) w [N, K]^T (bf16), on AMX tiles. Returns 0, or -1 (y untouched)
// where linear_amx_ready() is 0.
int64_t linear_amx_bf16w(const float* x, const bf16* w, float* y, int64_t M, int64_t N,
                         int64_t K) {
#if defined(KDASERVE_AMX)
  if (!granted()) return -1;
  linear_amx(x, w, y, M, N, K);
  return 0;
#else
  (void)x, (void)w, (void)y, (void)M, (void)N, (void)K;
  return -1;
#endif
}

}  // extern "C"
