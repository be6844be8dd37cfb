// Scalar helpers and the head-dim bound shared by the KDA sources (kda_cpu.cpp,
// kda_chunked_cpu.cpp). Included inside each source's anonymous namespace.

#pragma once

constexpr int kMaxDim = 512;  // head dims above this are refused on the Python side

inline float sigmoidf(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// torch.nn.functional.softplus(beta=1, threshold=20): identity above the threshold.
inline float softplusf(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

// fla's l2norm (eps added to the sum of squares), times an extra scale.
void l2norm(float* __restrict x, int64_t n, float scale) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = scale / std::sqrt(ss + 1e-6f);
  for (int64_t i = 0; i < n; ++i) x[i] *= r;
}
