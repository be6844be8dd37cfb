// exp, sigmoid and softplus over vtile lanes (and, with the same code, single floats), for
// the gates of the KDA kernels: libm's expf / log1pf are scalar calls (GCC uses glibc's vector
// versions only under -ffast-math), and a KDA decode step evaluates ~5 of them per channel of
// every head (measured 13-19 us per head and token at head dim 128 before). Included by
// kda_cpu.cpp inside its anonymous namespace, after tiles.h.
//
// exp: Cephes' single-precision scheme, x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two
// constants so n ln2 is exact), a degree-6 polynomial for e^r, 2^n put in the exponent bits;
// within ~2 ulp of expf. Outside the normal range the result is 0 (x < -87.3) or +inf
// (x > 88.3), so a gate never leaves a subnormal in a state. softplus: max(u, 0) +
// log1p(e^-|u|), with log1p(t) = 2 atanh(t / (2 + t)) for t in (0, 1] by its odd series;
// softplus(u) rounds to u above 17 in fp32, as torch's threshold of 20 does.

#pragma once

typedef int32_t vtile_i32 __attribute__((vector_size(sizeof(vtile))));

template <typename V> struct IntOf;
template <> struct IntOf<float> { using type = int32_t; };
template <> struct IntOf<vtile> { using type = vtile_i32; };

template <typename V> inline V splat(float x) { return V{} + x; }

template <typename V> inline V vexp(V x) {
  using I = typename IntOf<V>::type;
  const V lo = splat<V>(-87.3f), hi = splat<V>(88.3f);
  const V xc = x < lo ? lo : (x > hi ? hi : x);
  // n = round(x / ln2): adding 1.5 * 2^23 leaves the rounded integer in the low mantissa
  const V shifter = splat<V>(12582912.0f);
  const V nf = (xc * 1.44269504088896341f + shifter) - shifter;
  const V r = (xc - nf * 0.693359375f) + nf * 2.12194440e-4f;
  V p = splat<V>(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const V e = p * r * r + r + 1.0f;
  I n;
  if constexpr (sizeof(V) == sizeof(float)) n = static_cast<int32_t>(nf);
  else n = __builtin_convertvector(nf, I);
  const I bits = (n + 127) << 23;
  V scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  const V y = e * scale;
  return x < lo ? V{} : (x > hi ? splat<V>(__builtin_inff()) : y);
}

template <typename V> inline V vsigmoid(V x) { return 1.0f / (1.0f + vexp(-x)); }

template <typename V> inline V vsoftplus(V u) {
  const V t = vexp(u < 0.0f ? u : -u);  // e^-|u| in (0, 1]
  const V s = t / (2.0f + t), z = s * s;
  V p = splat<V>(1.0f / 15);
  p = p * z + 1.0f / 13;
  p = p * z + 1.0f / 11;
  p = p * z + 1.0f / 9;
  p = p * z + 1.0f / 7;
  p = p * z + 1.0f / 5;
  p = p * z + 1.0f / 3;
  p = p * z + 1.0f;
  return (u > 0.0f ? u : V{}) + 2.0f * s * p;
}

// tanh from e^(-2|x|) in (0, 1]: nothing overflows; about 1e-7 absolute error, which is
// what SiTU's soft caps need (their outputs are of order 1 to beta)
template <typename V> inline V vtanh(V x) {
  const V t = vexp(-2.0f * (x < 0.0f ? -x : x));
  const V r = (1.0f - t) / (1.0f + t);
  return x < 0.0f ? -r : r;
}

// y[i] = f(x[i]) for n floats: whole vectors, then the tail one float at a time (same code)
template <typename F> inline void map_lanes(const float* x, float* y, int64_t n, F f) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    vtile v;
    __builtin_memcpy(&v, x + i, sizeof(v));
    v = f(v);
    __builtin_memcpy(y + i, &v, sizeof(v));
  }
  for (; i < n; ++i) y[i] = f(x[i]);
}

// out[i] = SiLU(g[i]) * u[i] for n floats (the SwiGLU of a dense MLP or an expert)
inline void silu_mul_row(const float* g, const float* u, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vtile gv = load_tile(g + i), v = gv * vsigmoid(gv) * load_tile(u + i);
    __builtin_memcpy(out + i, &v, sizeof(v));
  }
  for (; i < n; ++i) out[i] = g[i] * vsigmoid(g[i]) * u[i];
}

// The gated activation of an MLP or an expert: SwiGLU (beta 0), or K3's SiTU-GLU,
// beta * tanh(g / beta) * sigmoid(g) * (linear_beta * tanh(u / linear_beta)), the up branch
// uncapped when linear_beta is 0 (kernels/ref/mlp.py: situ_mul_ref)
struct Glu {
  float beta = 0.0f;
  float linear_beta = 0.0f;
};

inline void glu_row(const Glu& a, const float* g, const float* u, float* out, int64_t n) {
  if (a.beta == 0.0f) {
    silu_mul_row(g, u, out, n);
    return;
  }
  const float b = a.beta, ib = 1.0f / a.beta, lb = a.linear_beta;
  const float ilb = lb != 0.0f ? 1.0f / lb : 0.0f;
  const auto f = [b, ib, lb, ilb](auto gv, auto uv) {
    const auto capped = lb != 0.0f ? lb * vtanh(uv * ilb) : uv;
    return b * vtanh(gv * ib) * vsigmoid(gv) * capped;
  };
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vtile v = f(load_tile(g + i), load_tile(u + i));
    __builtin_memcpy(out + i, &v, sizeof(v));
  }
  for (; i < n; ++i) out[i] = f(g[i], u[i]);
}
