// bf16 weights at many rows (prefill, batched decode) on AMX tiles, where the host has them
// (Intel Sapphire Rapids and later). The other paths widen bf16 weights to fp32 (in registers,
// or a whole copy for oneDNN), so a bf16 model's GEMMs ran no faster than fp32's; a tile
// multiply (TDPBF16PS, 16 x 16 outputs x 32 pairs) does 16x the products of an AVX-512 FMA.
// Its activations must be bf16 too, and rounding them (as GPU bf16 serving and llama.cpp do)
// would put a 2^-9 relative error on every product. So each activation is split into two bf16
// parts, hi = bf16(x) and lo = bf16(x - hi), and both are multiplied: hi + lo holds 16 of x's
// 24 mantissa bits (error <= 2^-17 |x|), products and sums stay fp32 in the tiles. That error
// is ~1/256 of what the bf16 weights themselves already carry, at twice the tile work.
// int8 weights (weight-only int8) ride on the same tiles: an 8-bit integer is exact in bf16, so
// each 32-row panel is converted on the way in and the row scales applied to the products;
// MXFP4 weights (K3's routed experts) likewise, an E2M1 value times its power-of-two scale
// being exact in bf16.
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
#include <type_traits>
#include <vector>

extern "C" {
// mxfp4_cpu.cpp
void mxfp4_rows_bf16(const uint8_t* w, const uint8_t* s, int64_t p, int64_t tn, int64_t K,
                     uint16_t* out, int64_t ldo);
}

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

// One chunk of an activation row (n <= 32 values from k0; the rest read as zero) as its hi
// and lo parts, each 16 dwords in pair order: dword i = the part's values at k0 + 2i, k0 + 2i + 1
// (the layout of a tile column).
inline void split_chunk(const float* row, int64_t n, __m512i& hbits, __m512i& lbits) {
  __m512 v0, v1;
  if (n == kChunk) {
    v0 = _mm512_loadu_ps(row);
    v1 = _mm512_loadu_ps(row + 16);
  } else {
    const int64_t n0 = std::min<int64_t>(16, n), n1 = n - n0;
    v0 = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n0) - 1), row);
    v1 = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n1) - 1), row + 16);
  }
  const __m512bh hi = _mm512_cvtne2ps_pbh(v1, v0);
  std::memcpy(&hbits, &hi, sizeof(hbits));
  // hi widened back to fp32: the even k values are the dwords' low halves, the odd the high
  // ones; interleaved again into k order to subtract from v0 (k0..k0+15) and v1
  const __m512i even = _mm512_slli_epi32(hbits, 16);
  const __m512i odd = _mm512_and_si512(hbits, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i second =
      _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  const __m512 h0 = _mm512_castsi512_ps(_mm512_permutex2var_epi32(even, first, odd));
  const __m512 h1 = _mm512_castsi512_ps(_mm512_permutex2var_epi32(even, second, odd));
  const __m512bh lo = _mm512_cvtne2ps_pbh(_mm512_sub_ps(v1, h1), _mm512_sub_ps(v0, h0));
  std::memcpy(&lbits, &lo, sizeof(lbits));
}

// x [M, K] -> B tiles: rows 16 g .. 16 g + 15 of x are columns 32 g + c (hi parts) and
// 32 g + 16 + c (lo parts), c = m - 16 g; tile (jb, kc) holds columns [16 jb, 16 jb + 16) over
// k in [32 kc, 32 kc + 32): dword (kk, c) = the column's values at k = 32 kc + 2 kk and the
// next one, so each chunk of a row's part is scattered down its tile column. xb is zeroed
// beforehand (padding rows and k). The scalar packing (a pair and an index per store) was a
// third of an expert block's time. Tasks are tile pairs (16 rows, one chunk): split by rows,
// two threads wrote halves of the same cache lines (16 x 2566 x 768 15% slower).
void pack_split(const float* x, int64_t M, int64_t K, int64_t nkc, uint32_t* xb,
                bool parallel) {
  const __m512i down = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(16));
  const int64_t groups = (M + 15) / 16;
#pragma omp parallel for schedule(static) collapse(2) if (parallel)
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t kc = 0; kc < nkc; ++kc) {
      uint32_t* hi_tile = xb + (2 * g * nkc + kc) * kTile;
      for (int64_t m = 16 * g; m < std::min(M, 16 * g + 16); ++m) {
        __m512i hbits, lbits;
        split_chunk(x + m * K + kc * kChunk, std::min(kChunk, K - kc * kChunk), hbits, lbits);
        _mm512_i32scatter_epi32(hi_tile + m % 16, down, hbits, 4);
        _mm512_i32scatter_epi32(hi_tile + nkc * kTile + m % 16, down, lbits, 4);
      }
    }
}

// The 32 x 32 outputs of one panel of 32 weight rows (a, stride lda) against the split
// activations of x rows m0 .. m1 (at most 16): B tiles b0 (their hi parts) and b1 (lo) over
// nkc chunks of k; hi + lo summed as vectors into y columns n0 .. n0 + rows (a scalar add and
// store per output was a sixth of an expert block's time).
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
  // hi + lo in place (ct[n][0..15] = y^T[n][m0..m0+15]), then each y row gathered from
  // the column of ct: L1 gathers and whole-vector stores (scattering the sums into y, 16
  // cache lines per vector, was slower than scalar stores)
  for (int64_t n = 0; n < kPanel; ++n)
    _mm512_store_ps(ct + n * kCols, _mm512_add_ps(_mm512_load_ps(ct + n * kCols),
                                                  _mm512_load_ps(ct + n * kCols + 16)));
  const __m512i down = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
      _mm512_set1_epi32(static_cast<int32_t>(kCols)));
  const __mmask16 first = static_cast<__mmask16>(rows >= 16 ? 0xFFFF : (1u << rows) - 1);
  const __mmask16 second =
      static_cast<__mmask16>(rows >= 32 ? 0xFFFF : rows <= 16 ? 0 : (1u << (rows - 16)) - 1);
  for (int64_t m = m0; m < m1; ++m) {
    const float* column = ct + (m - m0);
    _mm512_mask_storeu_ps(y + m * N + n0, first, _mm512_i32gather_ps(down, column, 4));
    if (second != 0)
      _mm512_mask_storeu_ps(y + m * N + n0 + 16, second,
                            _mm512_i32gather_ps(down, column + 16 * kCols, 4));
  }
}

// A panel's weight rows as the tiles read them: in place, or copied zero-padded into pad
// (kPanel x Kp) where the panel runs past the weight's last row or K is not a whole number of
// chunks (a tile row must not read past the weight, and bf16 garbage may be NaN, which a zero
// activation would not cancel).
inline const bf16* panel_rows(const bf16* w, int64_t N, int64_t K, int64_t Kp, int64_t n0,
                              std::unique_ptr<bf16[]>& pad, int64_t& lda) {
  const int64_t rows = std::min(kPanel, N - n0);
  lda = K;
  if (rows == kPanel && Kp == K) return w + n0 * K;
  if (!pad) pad.reset(new bf16[kPanel * Kp]);
  std::fill(pad.get(), pad.get() + kPanel * Kp, 0);
  for (int64_t r = 0; r < rows; ++r)
    std::copy(w + (n0 + r) * K, w + (n0 + r + 1) * K, pad.get() + r * Kp);
  lda = Kp;
  return pad.get();
}

// An int8 weight row as bf16: an integer of at most 8 bits is exact in bf16, and its fp32
// form has nothing in the low 16 bits, so the conversion is a widening and a shift.
inline void int8_row_to_bf16(const int8_t* src, bf16* dst, int64_t K) {
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512i wide = _mm512_cvtepi8_epi32(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(src + k)));
    const __m512i bits = _mm512_castps_si512(_mm512_cvtepi32_ps(wide));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
  }
  for (; k < K; ++k) {
    const float f = static_cast<float>(src[k]);
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    dst[k] = static_cast<bf16>(u >> 16);
  }
}

// int8 weights (weight-only int8, per-row scales applied by the caller) as bf16 panels,
// always copied into pad (32 rows x Kp, 48 KB at K = 768: it stays in L2 while the panel's
// columns pass over it).
inline const bf16* panel_rows(const int8_t* w, int64_t N, int64_t K, int64_t Kp, int64_t n0,
                              std::unique_ptr<bf16[]>& pad, int64_t& lda) {
  const int64_t rows = std::min(kPanel, N - n0);
  if (!pad) pad.reset(new bf16[kPanel * Kp]);
  bf16* dst = pad.get();
  for (int64_t r = 0; r < kPanel; ++r) {
    const int64_t n = r < rows ? K : 0;  // rows past the weight: all padding
    if (n != 0) int8_row_to_bf16(w + (n0 + r) * K, dst + r * Kp, K);
    std::fill(dst + r * Kp + n, dst + (r + 1) * Kp, 0);
  }
  lda = Kp;
  return dst;
}

// MXFP4 weights (codes [N, K / 2], E8M0 scales [N, K / 32]) as bf16 panels, decoded exactly
// (mxfp4_rows_bf16: two significant bits times a power of two) into pad; K is whole groups
// of 32, so whole tile chunks. A subnormal weight (scale code 0, value 2^-128) is read as zero
// by the tiles, as any bf16 subnormal: an error below 2^-126 in absolute terms.
struct Mxfp4 {
  const uint8_t* codes;
  const uint8_t* scales;
};

inline const bf16* panel_rows(Mxfp4 w, int64_t N, int64_t K, int64_t Kp, int64_t n0,
                              std::unique_ptr<bf16[]>& pad, int64_t& lda) {
  const int64_t rows = std::min(kPanel, N - n0);
  if (!pad) pad.reset(new bf16[kPanel * Kp]);
  mxfp4_rows_bf16(w.codes, w.scales, n0, rows, K, pad.get(), Kp);
  for (int64_t r = 0; r < kPanel; ++r)  // rows past the weight, and K up to Kp: padding
    std::fill(pad.get() + r * Kp + (r < rows ? K : 0), pad.get() + (r + 1) * Kp, 0);
  lda = Kp;
  return pad.get();
}

// Columns [j0, j1) of the packed activations xb against panel n0 of w, into y.
inline void panel_columns(const bf16* a, int64_t lda, const uint32_t* xb, int64_t nkc,
                          int64_t j0, int64_t j1, float* ct, float* y, int64_t M, int64_t N,
                          int64_t n0) {
  const int64_t rows = std::min(kPanel, N - n0);
  for (int64_t j = j0; j < j1; j += kCols) {
    const uint32_t* b0 = xb + (j / 16) * nkc * kTile;
    const int64_t m0 = j / 2;
    panel_block(a, lda, b0, b0 + nkc * kTile, nkc, ct, y, N, n0, rows, m0,
                std::min(M, m0 + kCols / 2));
  }
}

// Activation columns per pass over the weights: their B tiles (256 columns x 768 k: 384 KB)
// stay in L2 while every panel passes over them. Without the passes a 2,048-row product read
// all 6 MB of B tiles from L3 for each panel.
constexpr int64_t kPassCols = 256;

// x's split activations as B tiles, in `buffer` (resized to fit; zeroed for the padding).
struct Packed {
  int64_t Kp, nkc, Jp;
  uint32_t* xb;
  Packed(const float* x, int64_t M, int64_t K, bool parallel, std::vector<uint32_t>& buffer)
      : Kp((K + kChunk - 1) / kChunk * kChunk), nkc(Kp / kChunk),
        Jp((2 * M + kCols - 1) / kCols * kCols) {
    const size_t n = static_cast<size_t>(Jp / 16 * nkc * kTile);
    if (buffer.size() < n) buffer.resize(n);
    xb = buffer.data();
    std::fill(xb, xb + n, 0u);
    pack_split(x, M, K, nkc, xb, parallel);
  }
};

// y [M, N] = x [M, K] w [N, K]^T, w bf16 (or int8, converted a panel at a time): tasks are
// panels of 32 weight rows, each against every 32-column block of split activations (16 rows
// of x) of the pass.
template <typename W>
void linear_amx(const float* x, W w, float* y, int64_t M, int64_t N, int64_t K) {
  if constexpr (std::is_same_v<W, const int8_t*>) {
    // several passes over the panels (a prefill chunk: 16 at 2,048 rows) would convert each
    // panel again every pass; a weight that fits is converted once instead, in parallel, and
    // the product runs as the bf16 one (an lm_head never gets here with many rows: only
    // logits rows reach it)
    constexpr int64_t kWholeMax = int64_t{8} << 20;  // elements (16 MB of bf16)
    if (2 * M > kPassCols && N * K <= kWholeMax) {
      thread_local std::vector<bf16> whole;
      if (whole.size() < static_cast<size_t>(N * K)) whole.resize(N * K);
      bf16* dst = whole.data();
#pragma omp parallel for schedule(static)
      for (int64_t n = 0; n < N; ++n) int8_row_to_bf16(w + n * K, dst + n * K, K);
      return linear_amx(x, static_cast<const bf16*>(dst), y, M, N, K);
    }
  }
  std::vector<uint32_t> buffer;
  const Packed b(x, M, K, true, buffer);
  const int64_t panels = (N + kPanel - 1) / kPanel;
#pragma omp parallel
  {
    configure();
    alignas(64) float ct[kPanel * kCols];
    std::unique_ptr<bf16[]> pad;
    for (int64_t j0 = 0; j0 < b.Jp; j0 += kPassCols) {
#pragma omp for schedule(static) nowait
      for (int64_t p = 0; p < panels; ++p) {
        int64_t lda;
        const bf16* a = panel_rows(w, N, K, b.Kp, p * kPanel, pad, lda);
        panel_columns(a, lda, b.xb, b.nkc, j0, std::min(b.Jp, j0 + kPassCols), ct, y, M,
                      N, p * kPanel);
      }
    }
    _tile_release();
  }
}

// The same product on the calling thread alone (one task of a parallel loop: an expert's
// block of tokens), its few rows' activations packed once and every panel passed over them.
template <typename W>
void block_amx(const float* x, W w, float* y, int64_t M, int64_t N, int64_t K) {
  // kept per thread: a fresh 300 KB buffer per expert block went to mmap, and its page
  // faults cost as much as the block's products (64 experts top-8 at hidden 768, 2,048
  // tokens: 98 ms)
  thread_local std::vector<uint32_t> buffer;
  const Packed b(x, M, K, false, buffer);
  configure();
  alignas(64) float ct[kPanel * kCols];
  std::unique_ptr<bf16[]> pad;
  for (int64_t n0 = 0; n0 < N; n0 += kPanel) {
    int64_t lda;
    const bf16* a = panel_rows(w, N, K, b.Kp, n0, pad, lda);
    panel_columns(a, lda, b.xb, b.nkc, 0, b.Jp, ct, y, M, N, n0);
  }
  _tile_release();
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

// y [M, N] = x [M, K] (fp32) w [N, K]^T (bf16), on AMX tiles: over the OpenMP team, or
// (team == 0) on the calling thread alone, from inside a team's task. Returns 0, or -1 (y
// untouched) where linear_amx_ready() is 0.
int64_t linear_amx_bf16w(const float* x, const bf16* w, float* y, int64_t M, int64_t N,
                         int64_t K, int64_t team) {
#if defined(KDASERVE_AMX)
  if (!granted()) return -1;
  if (team != 0)
    linear_amx(x, w, y, M, N, K);
  else
    block_amx(x, w, y, M, N, K);
  return 0;
#else
  (void)x, (void)w, (void)y, (void)M, (void)N, (void)K, (void)team;
  return -1;
#endif
}

// The same for int8 weights with per-row scales (scale [N], nullable: the caller applies
// them), exact int8 -> bf16 panels on the same tiles: the activations keep their fp32 class
// where a VNNI int8 product would round them to 8 bits.
int64_t linear_amx_int8w(const float* x, const int8_t* w, const float* scale, float* y,
                         int64_t M, int64_t N, int64_t K, int64_t team) {
#if defined(KDASERVE_AMX)
  if (!granted()) return -1;
  if (team != 0)
    linear_amx(x, w, y, M, N, K);
  else
    block_amx(x, w, y, M, N, K);
  if (scale != nullptr) {
#pragma omp parallel for schedule(static) if (team != 0)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) y[m * N + n] *= scale[n];
  }
  return 0;
#else
  (void)x, (void)w, (void)scale, (void)y, (void)M, (void)N, (void)K, (void)team;
  return -1;
#endif
}

// The same for MXFP4 weights (codes [N, K / 2], scales [N, K / 32], K a multiple of 32),
// each 32-row panel decoded to exact bf16 on the way in.
int64_t linear_amx_mxfp4w(const float* x, const uint8_t* codes, const uint8_t* scales, float* y,
                          int64_t M, int64_t N, int64_t K, int64_t team) {
#if defined(KDASERVE_AMX)
  if (!granted() || K % 32 != 0) return -1;
  if (team != 0)
    linear_amx(x, Mxfp4{codes, scales}, y, M, N, K);
  else
    block_amx(x, Mxfp4{codes, scales}, y, M, N, K);
  return 0;
#else
  (void)x, (void)codes, (void)scales, (void)y, (void)M, (void)N, (void)K, (void)team;
  return -1;
#endif
}

}  // extern "C"
