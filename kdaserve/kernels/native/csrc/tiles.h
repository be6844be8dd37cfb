// Register tiles for the skinny GEMMs of both native libraries (kda_cpu.cpp and
// batch_invariant.cpp): the host's vector, the tile shape, weight loads that widen bf16 and
// int8 in registers, and the tile itself. Included by each source inside its anonymous
// namespace, after <cstdint> and (on x86) <immintrin.h>.

#pragma once

// The vector the linear tiles accumulate in, and their shape, by host: with AVX-512 (32
// registers) 16-lane vectors in 4 x 4 tiles; on AVX2 (16 registers) GCC splits a 16-lane type
// into register pairs and a 4 x 4 tile spills, so 8 lanes in 8 x 1 tiles (lm_head 100k x 768,
// weight GB/s at 4 / 8 / 16 / 32 rows: 6.8 / 3.6 / 1.9 / 1.0 before, 22.6 / 17.1 / 11.2 / 6.6
// after, measured on this AVX2 machine).
#if defined(__AVX512F__)
typedef float vtile __attribute__((vector_size(64)));
constexpr int kTileN = 4, kTileM = 4;
#else
typedef float vtile __attribute__((vector_size(32)));
constexpr int kTileN = 8, kTileM = 1;
#endif
constexpr int kLanes = sizeof(vtile) / sizeof(float);

// Below this many outputs a row-wise op runs on one thread: an OpenMP team's fork costs more
// than it saves on a decode step's few rows.
constexpr int64_t kParallelMin = 1 << 15;

inline vtile load_tile(const float* p) {
  vtile v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

// Weights are fp32 or bf16 (weight-only bf16: half the bytes a decode step streams; the
// activations and every sum stay fp32). A bf16 value is the top half of an fp32 one, so
// widening is a 16-bit shift, done in registers as the weights arrive.
typedef uint16_t bf16;
typedef uint16_t vtile_bf16 __attribute__((vector_size(sizeof(vtile) / 2)));
typedef uint32_t vtile_u32 __attribute__((vector_size(sizeof(vtile))));

// GCC's generic vectors lower the widening loads poorly (bf16 in 256-bit halves, int8 one lane
// at a time: 8 GB/s of weights), so x86 hosts get them as intrinsics.
#if defined(__AVX512F__)
inline vtile load_tile(const bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#elif defined(__AVX2__)
inline vtile load_tile(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#else
inline vtile load_tile(const bf16* p) {
  vtile_bf16 h;
  __builtin_memcpy(&h, p, sizeof(h));
  const vtile_u32 u = __builtin_convertvector(h, vtile_u32) << 16;
  vtile v;
  __builtin_memcpy(&v, &u, sizeof(v));
  return v;
}
#endif

// int8 weights (weight-only int8, a scale per output row applied to each finished sum): a
// quarter of the fp32 bytes, converted in registers like bf16.
typedef int8_t vtile_i8 __attribute__((vector_size(sizeof(vtile) / 4)));

#if defined(__AVX512F__)
inline vtile load_tile(const int8_t* p) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
}
#elif defined(__AVX2__)
inline vtile load_tile(const int8_t* p) {
  const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
}
#else
inline vtile load_tile(const int8_t* p) {
  vtile_i8 q;
  __builtin_memcpy(&q, p, sizeof(q));
  return __builtin_convertvector(q, vtile);
}
#endif

// One value in every lane (a vbroadcastss: GCC lowers a lane-by-lane fill to a chain of
// inserts that made the broadcast GEMM below 2x slower).
#if defined(__AVX512F__)
inline vtile splat(float f) { return _mm512_set1_ps(f); }
#elif defined(__AVX2__)
inline vtile splat(float f) { return _mm256_set1_ps(f); }
#else
inline vtile splat(float f) {
  vtile v;
  for (int l = 0; l < kLanes; ++l) v[l] = f;
  return v;
}
#endif

inline float widen(int8_t w) { return static_cast<float>(w); }
inline float widen(float w) { return w; }
inline float widen(bf16 w) {
  const uint32_t u = static_cast<uint32_t>(w) << 16;
  float f;
  __builtin_memcpy(&f, &u, sizeof(f));
  return f;
}

// Lanes summed in order (batch_invariant.cpp's dot() sums the same way, so a tile's value
// equals its dot product there).
inline float hsum(vtile acc) {
  float s = 0.0f;
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  return s;
}

// Lanes summed as a tree, for products that need not match batch_invariant.cpp: the ordered
// sum is 15 dependent adds, which cost as much as the dot itself on the experts' 128-wide rows.
inline float hsum_tree(vtile a) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(a);
#elif defined(__AVX2__)
  __m128 v = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  v = _mm_add_ps(v, _mm_movehl_ps(v, v));
  return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
#else
  return hsum(a);
#endif
}

// TN weight rows (stride K) dotted with TM x rows (stride K); y[tm * N + tn]. kOrdered: lanes
// summed in order (hsum), so each value equals batch_invariant.cpp's dot. pf (nullable): the
// next tile's rows, fetched a cache line per row per 64 bytes of weights while this one
// computes (a prefetch per vector asked for an int8 line eight times).
template <int TN, int TM, bool kOrdered = true, typename W>
inline void dot_tile(const W* __restrict w, const float* __restrict x, float* __restrict y,
                     int64_t N, int64_t K, const W* pf = nullptr) {
  vtile acc[TN][TM] = {};
  int64_t j = 0;
  for (; j + kLanes <= K; j += kLanes) {
    if (pf != nullptr && j % (64 / sizeof(W)) == 0)  // once per cache line of each row
      for (int tn = 0; tn < TN; ++tn) __builtin_prefetch(pf + tn * K + j, 0, 3);
    vtile xv[TM];
    for (int tm = 0; tm < TM; ++tm) xv[tm] = load_tile(x + tm * K + j);
    for (int tn = 0; tn < TN; ++tn) {
      const vtile wv = load_tile(w + tn * K + j);
      for (int tm = 0; tm < TM; ++tm) acc[tn][tm] += wv * xv[tm];
    }
  }
  for (int tn = 0; tn < TN; ++tn)
    for (int tm = 0; tm < TM; ++tm) {
      float sum = kOrdered ? hsum(acc[tn][tm]) : hsum_tree(acc[tn][tm]);
      for (int64_t l = j; l < K; ++l) sum += widen(w[tn * K + l]) * x[tm * K + l];
      y[tm * N + tn] = sum;
    }
}
