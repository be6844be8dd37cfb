// An expert's many tokens as blocks against the broadcast tiles (gemm_blocks.h), shared by the
// float/bf16/int8 experts (moe_cpu.cpp) and the MXFP4 ones (mxfp4_cpu.cpp): the block's scratch,
// its x rows gathered transposed, its outputs scattered back. Included inside each source's
// anonymous namespace, after gemm_blocks.h.

#pragma once

// An expert's tokens from this many on run as blocks of up to kBlockRows tokens, each block
// one task that computes its tokens' whole expert (gather, gate/up, SiLU, down) against x^T
// and activations^T in the broadcast tiles, the expert's weights (1.2 MB on the bench model)
// read from L2/L3 once per block. Fewer tokens split the expert's weight rows over tasks
// instead (moe_cpu.cpp's moe_experts), which keeps both cores busy on a decode step's few
// tokens.
constexpr int64_t kBlockRows = 2 * kBV * kLanes;

// Which experts stream their few tokens (`small`: fewer than blocked_from) and which run as
// token blocks (`blocks`: (expert, s0, s1) in sorted order), from ExpertOrder's offsets; an
// expert's blocks are equal, so one of 100 tokens is not 96 + 4.
struct ExpertPlan {
  std::vector<int64_t> small;
  std::vector<std::array<int64_t, 3>> blocks;
  ExpertPlan(const std::vector<int64_t>& offset, int64_t E, int64_t blocked_from) {
    for (int64_t e = 0; e < E; ++e) {
      const int64_t cnt = offset[e + 1] - offset[e];
      if (cnt == 0) continue;
      if (cnt < blocked_from) {
        small.push_back(e);
        continue;
      }
      const int64_t parts = (cnt + kBlockRows - 1) / kBlockRows;
      for (int64_t p = 0; p < parts; ++p)
        blocks.push_back({e, offset[e] + cnt * p / parts, offset[e] + cnt * (p + 1) / parts});
    }
  }
};

// Scratch of one thread for blocked experts, all transposed and zero-padded to whole vectors
// of tokens (stride Mp): a block's x^T, its gate/up rows (h^T), activations (a^T, the down
// projection's x^T) and outputs (y^T); and a panel of widened weights.
struct BlockScratch {
  std::unique_ptr<float[]> xt, ht, at, yt, wide;
  BlockScratch(int64_t I, int64_t D)
      : xt(new float[D * kBlockRows]), ht(new float[2 * I * kBlockRows]),
        at(new float[I * kBlockRows]), yt(new float[D * kBlockRows]),
        wide(new float[kBN * std::max(I, D)]) {}
};

// x^T of a block of rows: xt[d * Mp + m] = x[row[m] + d] for m < M, zero up to Mp. The
// scalar transpose (a load and a store an element) was half of a block's time outside the
// products; AVX-512 gathers a vector of rows at each d instead, elsewhere it is fill_xt's.
inline void gather_t(const float* x, const int32_t* row, int64_t M, int64_t Mp, int64_t D,
                     float* xt) {
#if defined(__AVX512F__)
  for (int64_t m0 = 0; m0 < Mp; m0 += kLanes) {
    const __mmask16 live = M - m0 >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (M - m0)) - 1);
    const __m512i idx = _mm512_maskz_loadu_epi32(live, row + m0);
    for (int64_t d = 0; d < D; ++d)
      _mm512_storeu_ps(xt + d * Mp + m0,
                       _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, idx, x + d, 4));
  }
#else
  fill_xt(x, [row](int64_t m) { return row[m]; }, M, D, Mp, Mp, xt, 0, D);  // one block
#endif
}

// The block's output rows from y^T: ys[m * D + d] = yt[d * Mp + m] * wt[m] * scale[d] for m
// < M (scale nullable), gathered a vector at a time on AVX-512, 8 x 8 blocks transposed in
// registers on AVX2.
inline void scatter_t(const float* yt, int64_t M, int64_t Mp, int64_t D, const float* scale,
                      const float* wt, float* ys) {
  int64_t d0 = 0;
#if defined(__AVX512F__)
  const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6,
                                                          5, 4, 3, 2, 1, 0),
                                         _mm512_set1_epi32(static_cast<int32_t>(Mp)));
  d0 = D / 16 * 16;
  for (int64_t m = 0; m < M; ++m) {
    const __m512 w = _mm512_set1_ps(wt[m]);
    for (int64_t d = 0; d < d0; d += 16) {
      __m512 v = _mm512_mul_ps(_mm512_i32gather_ps(idx, yt + d * Mp + m, 4), w);
      if (scale != nullptr) v = _mm512_mul_ps(v, _mm512_loadu_ps(scale + d));
      _mm512_storeu_ps(ys + m * D + d, v);
    }
  }
#elif defined(__AVX2__)
  d0 = D / 8 * 8;
  for (int64_t m0 = 0; m0 < M; m0 += 8)  // y^T's padding up to Mp is read, never stored
    for (int64_t d = 0; d < d0; d += 8) {
      __m256 r[8];
      for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(yt + (d + j) * Mp + m0);
      transpose8(r);
      for (int j = 0; j < 8 && m0 + j < M; ++j) {
        __m256 v = _mm256_mul_ps(r[j], _mm256_set1_ps(wt[m0 + j]));
        if (scale != nullptr) v = _mm256_mul_ps(v, _mm256_loadu_ps(scale + d));
        _mm256_storeu_ps(ys + (m0 + j) * D + d, v);
      }
    }
#endif
  for (int64_t m = 0; m < M; ++m)
    for (int64_t d = d0; d < D; ++d)
      ys[m * D + d] = yt[d * Mp + m] * wt[m] * (scale != nullptr ? scale[d] : 1.0f);
}

// A block on AMX tiles (amx_cpu.cpp), row-major throughout where the broadcast tiles are
// transposed: the scratch's buffers hold x [M, D], h [M, 2I], a [M, I] and y [M, D]. The
// caller's products (gate_up(x, h), down(a, y): its weight format's AMX entry point, on this
// thread) run between the gather, the GLU and the weighted store shared by every format.
template <typename GateUp, typename Down>
inline void amx_block(const float* x, const int64_t* order, const float* weights, float* ys,
                      int64_t s0, int64_t s1, int64_t k, int64_t I, int64_t D, BlockScratch& b,
                      const Glu& act, GateUp gate_up, Down down) {
  const int64_t M = s1 - s0;
  float *xr = b.xt.get(), *hr = b.ht.get(), *ar = b.at.get(), *yr = b.yt.get();
  for (int64_t m = 0; m < M; ++m)
    std::copy(x + (order[s0 + m] / k) * D, x + (order[s0 + m] / k + 1) * D, xr + m * D);
  gate_up(xr, hr);
  for (int64_t m = 0; m < M; ++m) glu_row(act, hr + m * 2 * I, hr + m * 2 * I + I, ar + m * I, I);
  down(ar, yr);
  for (int64_t m = 0; m < M; ++m) {
    const float wt = weights[order[s0 + m]];
    for (int64_t d = 0; d < D; ++d) ys[(s0 + m) * D + d] = yr[m * D + d] * wt;
  }
}

// Inside a team: the plan's token blocks, taken as threads free up (blocks differ in size and
// in where their weights come from), each given this thread's scratch. No barrier after: the
// caller's streamed-expert loops that follow end in one.
template <typename Block>
inline void run_blocks(const ExpertPlan& plan, int64_t I, int64_t D, Block block) {
  if (plan.blocks.empty()) return;
  BlockScratch scratch(I, D);
  const int64_t B = static_cast<int64_t>(plan.blocks.size());
#pragma omp for schedule(dynamic, 1) nowait
  for (int64_t b = 0; b < B; ++b) block(plan.blocks[b], scratch);
}
