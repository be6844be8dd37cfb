// A batch's (token, choice) pairs grouped by expert, and the per-token sum of the pairs'
// outputs: the bookkeeping both expert kernels share (moe_cpu.cpp: float, bf16 and int8
// weights; mxfp4_cpu.cpp: MXFP4). Included inside their anonymous namespaces, after
// <vector> and <cstdint>.

#pragma once

struct ExpertOrder {
  std::vector<int64_t> offset;  // [E + 1]: expert e's pairs sit at sorted positions [e, e + 1)
  std::vector<int64_t> order;   // sorted position -> choice (t * k + j)
  std::vector<int64_t> slot;    // choice -> sorted position

  ExpertOrder(const int64_t* ids, int64_t n, int64_t E) : offset(E + 1, 0), order(n), slot(n) {
    for (int64_t c = 0; c < n; ++c) ++offset[ids[c] + 1];
    for (int64_t e = 0; e < E; ++e) offset[e + 1] += offset[e];
    std::vector<int64_t> fill(offset.begin(), offset.end() - 1);
    for (int64_t c = 0; c < n; ++c) {
      slot[c] = fill[ids[c]]++;
      order[slot[c]] = c;
    }
  }
};

// out[t] = the sum over token t's k choices of their rows of ys (sorted order), in choice
// order; inside an OpenMP team, tokens split over it
inline void sum_choices(const float* ys, const int64_t* slot, float* out, int64_t T, int64_t k,
                        int64_t D) {
#pragma omp for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    float* __restrict o = out + t * D;
    for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      const float* __restrict y = ys + slot[t * k + j] * D;
      for (int64_t d = 0; d < D; ++d) o[d] += y[d];
    }
  }
}
