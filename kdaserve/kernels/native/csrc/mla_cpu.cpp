// Weight-absorbed MLA decode straight from the paged latent cache, fp32; built into the
// kda_cpu library (build.py) and tested against kdaserve/kernels/ref's mla_attention_ref.
//
// Every head of every new token of a sequence attends to the same latent rows [R | Dr], so a
// task takes one sequence's new tokens and a group of its heads (all of them once there are
// enough sequences to keep the threads busy) and passes over the sequence's latents twice:
// scores for all its queries per latent row (the row read once, dotted with the queries in
// register tiles), then the weighted latents per query. Taking one (token, head) at a time
// read the latents once per query and ran verify steps at ~9 GFLOP/s.

#include <algorithm>
#include <cmath>
#include <cstdint>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <vector>

#include <omp.h>

namespace {

#include "tiles.h"
#include "vmath.h"

// o[r0, r0 + V lanes) = sum_t p[t] * rows[t][r0, ...), accumulated in registers
template <int V>
inline void weighted_chunk(const float* const* rows, const float* p, int64_t L, int64_t r0,
                           float* __restrict o) {
  vtile acc[V] = {};
  for (int64_t t = 0; t < L; ++t) {
    const vtile w = splat(p[t]);
    for (int v = 0; v < V; ++v) acc[v] += w * load_tile(rows[t] + r0 + v * kLanes);
  }
  for (int v = 0; v < V; ++v) __builtin_memcpy(o + r0 + v * kLanes, &acc[v], sizeof(vtile));
}

// o [R] = sum_t p[t] * rows[t][0:R]: 8 independent accumulators where R allows (one
// dependent chain per vector stalls on the add latency), then 4, 1, and a scalar tail
void weighted_rows(const float* const* rows, const float* p, int64_t L, int64_t R,
                   float* __restrict o) {
  int64_t r0 = 0;
  for (; r0 + 8 * kLanes <= R; r0 += 8 * kLanes) weighted_chunk<8>(rows, p, L, r0, o);
  for (; r0 + 4 * kLanes <= R; r0 += 4 * kLanes) weighted_chunk<4>(rows, p, L, r0, o);
  for (; r0 + kLanes <= R; r0 += kLanes) weighted_chunk<1>(rows, p, L, r0, o);
  for (int64_t r = r0; r < R; ++r) {
    float acc = 0.0f;
    for (int64_t t = 0; t < L; ++t) acc += p[t] * rows[t][r];
    o[r] = acc;
  }
}

// p[(j + c) * L + t] = q[j + c] . row for c < TN
template <int TN>
inline void scores(const float* q, int64_t j, int64_t D, const float* row, float* p, int64_t L,
                   int64_t t) {
  float tile[TN];
  dot_tile<TN, 1, false>(q + j * D, row, tile, 0, D);
  for (int c = 0; c < TN; ++c) p[(j + c) * L + t] = tile[c];
}

// The last n < kTileN queries in one tile: taken one at a time, each is a single dependent
// chain of FMAs (6 heads on AVX2 were a tile of 4 and two chains, which took most of the
// scores' time). A value is the same sum in any tile.
inline void scores_tail(const float* q, int64_t j, int64_t n, int64_t D, const float* row,
                        float* p, int64_t L, int64_t t) {
  switch (n) {
    case 7: return scores<7>(q, j, D, row, p, L, t);
    case 6: return scores<6>(q, j, D, row, p, L, t);
    case 5: return scores<5>(q, j, D, row, p, L, t);
    case 4: return scores<4>(q, j, D, row, p, L, t);
    case 3: return scores<3>(q, j, D, row, p, L, t);
    case 2: return scores<2>(q, j, D, row, p, L, t);
    case 1: return scores<1>(q, j, D, row, p, L, t);
    default: return;
  }
}

}  // namespace

extern "C" {

// q_lat [T, H, R] (q_nope already multiplied by W_UK); q_pe [T, H, Dr]; kv [NB*BS, R+Dr]
// rows; block_table [S, M]; context_lens [S] (cached tokens, the new ones included);
// cu_seqlens [S + 1]: sequence s owns new tokens cu[s]..cu[s+1], token i of its n sees the
// first lens[s] - n + i + 1 latents; out [T, H, R] attention-weighted latents (W_UV is
// applied by the caller).
void mla_decode_f32(const float* q_lat, const float* q_pe, const float* kv,
                    const int64_t* block_table, const int64_t* context_lens,
                    const int64_t* cu_seqlens, float* out, int64_t S, int64_t H, int64_t R,
                    int64_t Dr, int64_t BS, int64_t M, float scale) {
  const int64_t D = R + Dr;
  // Heads per task (hc): the fewest rounds of tasks per thread, each costing its heads plus
  // one pass over the sequence's latents (counted as one head): 16 sequences of 6 heads on 2
  // threads take all heads together (latents read once a sequence), one sequence 2 x 3 heads
  // (it was 3 x 2: one thread ran two tasks and read the latents twice).
  const int64_t threads = omp_get_max_threads();
  int64_t hc = H, best = INT64_MAX;
  for (int64_t c = H; c >= 1; --c) {
    const int64_t tasks = S * ((H + c - 1) / c), rounds = (tasks + threads - 1) / threads;
    if (rounds * (c + 1) < best) {
      best = rounds * (c + 1);
      hc = c;
    }
  }
  const int64_t groups = (H + hc - 1) / hc;
#pragma omp parallel for schedule(dynamic)
  for (int64_t task = 0; task < S * groups; ++task) {
    const int64_t s = task / groups, h0 = (task % groups) * hc, h1 = std::min(H, h0 + hc);
    if (h0 >= h1) continue;
    const int64_t t0 = cu_seqlens[s], n = cu_seqlens[s + 1] - t0, L = context_lens[s];
    const int64_t nh = h1 - h0, nq = n * nh;  // queries: (token i, head h) -> i * nh + h - h0
    if (n == 0) continue;
    std::vector<float> q(nq * D), p(nq * L);  // p: each query's scores, then weights
    std::vector<const float*> rows(L);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = h0; h < h1; ++h) {
        float* dst = q.data() + (i * nh + h - h0) * D;
        std::copy(q_lat + ((t0 + i) * H + h) * R, q_lat + ((t0 + i) * H + h + 1) * R, dst);
        std::copy(q_pe + ((t0 + i) * H + h) * Dr, q_pe + ((t0 + i) * H + h + 1) * Dr, dst + R);
      }
    const int64_t* table = block_table + s * M;
    for (int64_t t = 0; t < L; ++t) rows[t] = kv + (table[t / BS] * BS + t % BS) * D;
    // scores: each latent row against kTileN queries at a time, then the rest in one tile
    for (int64_t t = 0; t < L; ++t) {
      int64_t j = 0;
      for (; j + kTileN <= nq; j += kTileN) scores<kTileN>(q.data(), j, D, rows[t], p.data(), L, t);
      scores_tail(q.data(), j, nq - j, D, rows[t], p.data(), L, t);
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t Li = L - n + i + 1;  // causal: this token's own latent is its last
      for (int64_t h = 0; h < nh; ++h) {
        float* __restrict pc = p.data() + (i * nh + h) * L;
        float mx = -INFINITY;
        for (int64_t t = 0; t < Li; ++t) mx = std::max(mx, pc[t] *= scale);
        map_lanes(pc, pc, Li, [mx](auto v) { return vexp(v - mx); });
        float sum = 0.0f;
        for (int64_t t = 0; t < Li; ++t) sum += pc[t];
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < Li; ++t) pc[t] *= inv;
        weighted_rows(rows.data(), pc, Li, R, out + ((t0 + i) * H + h0 + h) * R);
      }
    }
  }
}

// The whole absorbed attention of an MLA layer: q [T rows of stride q_stride; head h at
// h * (Dn + Dr): its nope part, then its rope part]; w_kvb [H, Dn + Dv, R] (kv_b_proj per head:
// W_UK rows, then W_UV rows); out [T, H, Dv]. q_lat = q_nope W_UK and out = o_lat W_UV^T are
// computed here (torch's bmm cost a small model's decode step ~30 us a layer in dispatch).
void mla_forward_f32(const float* q, int64_t q_stride, const float* w_kvb, const float* kv,
                     const int64_t* block_table, const int64_t* context_lens,
                     const int64_t* cu_seqlens, float* out, int64_t S, int64_t T, int64_t H,
                     int64_t Dn, int64_t Dr, int64_t Dv, int64_t R, int64_t BS, int64_t M,
                     float scale) {
  std::vector<float> q_lat(T * H * R), q_pe(T * H * Dr), o_lat(T * H * R);
  const int64_t per_head = (Dn + Dv) * R;
  const bool parallel = T * H * (Dn + Dv) * R >= (1 << 16);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t task = 0; task < T * H; ++task) {
    const int64_t t = task / H, h = task % H;
    const float* qh = q + t * q_stride + h * (Dn + Dr);
    const float* wk = w_kvb + h * per_head;
    float* __restrict ql = q_lat.data() + task * R;
    for (int64_t r = 0; r < R; ++r) ql[r] = 0.0f;
    for (int64_t d = 0; d < Dn; ++d) {
      const float a = qh[d];
      const float* __restrict wr = wk + d * R;
      for (int64_t r = 0; r < R; ++r) ql[r] += a * wr[r];
    }
    std::copy(qh + Dn, qh + Dn + Dr, q_pe.data() + task * Dr);
  }
  mla_decode_f32(q_lat.data(), q_pe.data(), kv, block_table, context_lens, cu_seqlens,
                 o_lat.data(), S, H, R, Dr, BS, M, scale);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t task = 0; task < T * H; ++task) {
    const int64_t h = task % H;
    const float* wv = w_kvb + h * per_head + Dn * R;
    // kTileN rows of W_UV at a time: independent sums (one row at a time was a dependent
    // chain of FMAs per output, ~15% of a 64-sequence decode's attention). One token a head,
    // with W_UV coming from memory, reads it row after row instead: kTileN interleaved row
    // streams took 13-15 us a head's 128 KB, one stream 6-8 (2-core AMD EPYC, Zen 4; the
    // `bench` MLA at one token, cold: the phase 50 -> 23 us).
    int64_t v = 0;
    const int64_t tiled = T * H >= 4 * omp_get_max_threads() ? Dv : 0;
    for (; v + kTileN <= tiled; v += kTileN)
      dot_tile<kTileN, 1, false>(wv + v * R, o_lat.data() + task * R, out + task * Dv + v, Dv, R);
    for (; v < Dv; ++v)
      dot_tile<1, 1, false>(wv + v * R, o_lat.data() + task * R, out + task * Dv + v, Dv, R);
  }
}

}  // extern "C"
