// A whole decode forward (embedding to final norm) in one call, for models small enough that
// Python between the kernels is a large part of a step (the hidden-256 MoE at batch 16: ~2.5
// of ~12 ms; at batch 1 ~1.7 of 5), Kimi Linear and K3 (its Attention Residuals, gates,
// LatentMoE and SiTU-GLU): one token per sequence, or a few (a speculative verify, which also
// records each KDA layer's step inputs for the rollback). It runs the same kernels
// as the per-op path, in the same order and on the same inputs (the entry points below are
// the ones kernels/native/ops.py binds), so its result equals that path's bit for bit;
// kdaserve/engine/native_decode.py builds the plan and decides when it applies. Built into
// the kda_cpu library (build.py).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

extern "C" {
// defined in gemm_cpu.cpp, kda_cpu.cpp, mla_cpu.cpp, elementwise_cpu.cpp
void linear_small_f32(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K);
void linear_small_bf16w(const float* x, const uint16_t* w, float* y, int64_t M, int64_t N,
                        int64_t K);
void linear_small_int8w(const float* x, const int8_t* w, const float* scale, float* y,
                        int64_t M, int64_t N, int64_t K);
void kda_decode_f32(const float* qkv, const float* f, const float* beta, const float* z,
                    const float* conv_w, const float* A_log, const float* dt_bias,
                    const float* norm_w, float* state, float* conv_state, const int64_t* slots,
                    const int64_t* cu, float* out, int64_t B, int64_t H, int64_t K, int64_t V,
                    int64_t W, float eps, float lower_bound);
void mla_forward_f32(const float* q, int64_t q_stride, const float* w_kvb, const float* kv,
                     const int64_t* block_table, const int64_t* context_lens,
                     const int64_t* cu_seqlens, float* out, int64_t S, int64_t T, int64_t H,
                     int64_t Dn, int64_t Dr, int64_t Dv, int64_t R, int64_t BS, int64_t M,
                     float scale);
void moe_experts_f32(const float* x, const int64_t* ids, const float* weights, const float* w13,
                     const float* w2, float* out, int64_t T, int64_t k, int64_t E, int64_t I,
                     int64_t D, int64_t blocked_from, float beta, float linear_beta);
void moe_experts_bf16w(const float* x, const int64_t* ids, const float* weights,
                       const uint16_t* w13, const uint16_t* w2, float* out, int64_t T, int64_t k,
                       int64_t E, int64_t I, int64_t D, int64_t blocked_from, float beta,
                       float linear_beta);
void moe_experts_int8w(const float* x, const int64_t* ids, const float* weights,
                       const int8_t* w13, const int8_t* w2, const float* s13, const float* s2,
                       float* out, int64_t T, int64_t k, int64_t E, int64_t I, int64_t D,
                       int64_t blocked_from, float beta, float linear_beta);
void moe_experts_mxfp4(const float* x, const int64_t* ids, const float* weights,
                       const uint8_t* w13, const uint8_t* s13, const uint8_t* w2,
                       const uint8_t* s2, float* out, int64_t T, int64_t k, int64_t E,
                       int64_t I, int64_t D, float beta, float linear_beta);
void moe_route_f32(const float* logits, const float* bias, float* weights, int64_t* ids,
                   int64_t T, int64_t E, int64_t top_k, int64_t groups, int64_t topk_group,
                   int64_t renormalize, int64_t sigmoid, float scaling);
void silu_mul_f32(const float* gu, float* y, int64_t rows, int64_t I);
void situ_mul_f32(const float* gu, float* y, int64_t rows, int64_t I, float beta,
                  float linear_beta);
void sigmoid_mul_f32(const float* x, const float* g, float* y, int64_t n);
void attn_res_norm_f32(const float* bank, int64_t NB, const float* partial, const float* w_eff,
                       float eps, const float* norm_w, float norm_eps, float* out, int64_t T,
                       int64_t D);
void rms_norm_f32(const float* x, int64_t x_stride, const float* w, float* y, int64_t rows,
                  int64_t D, float eps);
}

namespace {

// A projection: weight [n, k] of `dtype` (0 fp32, 1 bf16, 2 int8 with per-row `scale`).
struct Linear {
  int64_t w, dtype, scale, n, k;
};

// One decoder layer; pointers as integers. The layout is mirrored field for field by
// kdaserve/engine/native_decode.py's `struct` format, which packs it once and again whenever a
// tensor it points to was replaced (a resume, quantization).
struct Layer {
  int64_t is_kda, is_moe;
  int64_t input_norm, post_norm;  // [D] fp32
  // KDA: in_proj rows q|k|v|f_a|g_a|b, f_b and g_b [H*K, K], o_proj; conv_w [3P, W]
  Linear in_proj, f_b, g_b, kda_o;
  int64_t conv_w, A_log, dt_bias, o_norm, state, conv_state, heads, head_dim, conv_size;
  // MLA (NoPE): q [H*(Dn+Dr)] (or q_a, its norm and q_b below), kv_a [R+Dr], the kv_a norm [R],
  // kv_b [H*(Dn+Dv), R]
  Linear q_proj, kv_a, mla_o;
  int64_t kv_a_norm, kv_b, kv_cache, mla_heads, dn, dr, dv, rank, block_size;
  // dense MLP, or the MoE's shared expert (gate_up.w == 0: none)
  Linear gate_up, down;
  // routed experts: router [E, D] fp32, bias [E] (nullable), w13 [E, 2I, D], w2 [E, D, I]
  // (expert_dtype 3: MXFP4, s13 / s2 its E8M0 scales; expert_inter is then unpacked)
  int64_t router, router_bias, w13, w2, expert_dtype, s13, s2, experts, expert_inter, top_k,
      groups, topk_group, renormalize, sigmoid;
  Linear q_a, q_b;  // MLA with a q LoRA (q_a.w != 0): q = q_b(norm(q_a(x)))
  int64_t q_a_norm;
  double kda_eps, mla_scale, latent_eps, routed_scaling;
  // K3, all zero for Kimi Linear: MLA's output gate g_proj; LatentMoE's projections around
  // the experts (lat_down.w == 0: experts at the hidden width) and the latent sum's RMSNorm
  // weight (nullable); the AttnRes sites before the mixer and the MLP (norm weight, projection
  // weight, fp32 [D]); the KDA gate's lower bound (0: Kimi Linear's gate) and the gated
  // activation of every MLP and expert (act_beta 0: SwiGLU, else SiTU-GLU)
  Linear mla_gate, lat_down, lat_up;
  int64_t lat_norm, attn_site[2], mlp_site[2];
  double kda_lower_bound, act_beta, act_linear_beta, lat_eps;
};

struct Model {
  int64_t num_layers, hidden, embed, final_norm;
  int64_t moe_blocked_from;  // as the per-op forward passes it (ops.moe_blocked_from)
  double eps;
  int64_t attn_res_block;  // K3's AttnRes block size (0: plain residuals)
  int64_t out_site[2];     // the AttnRes site before the final norm
  double site_eps;         // the sites' own RMS epsilon
};

template <typename T>
const T* ptr(int64_t p) {
  return reinterpret_cast<const T*>(p);
}

void linear(const Linear& l, const float* x, float* y, int64_t M) {
  if (l.dtype == 1)
    linear_small_bf16w(x, ptr<uint16_t>(l.w), y, M, l.n, l.k);
  else if (l.dtype == 2)
    linear_small_int8w(x, ptr<int8_t>(l.w), ptr<float>(l.scale), y, M, l.n, l.k);
  else
    linear_small_f32(x, ptr<float>(l.w), y, M, l.n, l.k);
}

// dst [M, n] = columns [c0, c0 + n) of src [M, ld]: a projection output's split made contiguous
// (the per-op path's `.contiguous()` of the same view)
void columns(const float* src, int64_t ld, int64_t c0, int64_t n, float* dst, int64_t M) {
  for (int64_t m = 0; m < M; ++m) std::memcpy(dst + m * n, src + m * ld + c0, n * sizeof(float));
}

void add(float* h, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) h[i] = h[i] + x[i];
}

// A context drafter's taps (ForwardBatch.taps): the rows after each of `layers` go to column
// block j of out [B, n * D]; with `aggregated` on K3, the mix the next site would form (the
// output site's after the last layer) rather than the partial sum (models/kimi_linear.py
// `_tap`). n = 0: no taps.
struct Taps {
  const int64_t* layers;
  int64_t n, aggregated;
  float* out;

  int64_t index(int64_t layer) const {
    for (int64_t j = 0; j < n; ++j)
      if (layers[j] == layer) return j;
    return -1;
  }
  void put(int64_t j, const float* rows, int64_t B, int64_t D) const {
    for (int64_t b = 0; b < B; ++b)
      std::memcpy(out + (b * n + j) * D, rows + b * D, D * sizeof(float));
  }
};

// The rows' sequences: S of them, rows cu[s]..cu[s + 1] (one each in a plain decode step), their
// KDA state slots, MLA block tables and context lengths [S], each row's KV slot [T]. record
// (nullable): a verify's StepRecord, three pointers per KDA layer in order (pre-conv q|k|v
// [T, 3P], the raw gate f [T, P], beta's logits [T, H]) that the layer writes its step inputs
// into (step_record.py).
struct Batch {
  int64_t S;
  const int64_t *cu, *slots, *table;
  int64_t table_width;
  const int64_t *lens, *slot_mapping, *record;

  // kda_decode_f32's cu: none for one row per sequence, as the per-op forward passes it
  const int64_t* kda_cu(int64_t T) const { return T == S ? nullptr : cu; }
  float* recorded(int64_t kda_layer, int64_t part) const {
    return record == nullptr ? nullptr
                             : reinterpret_cast<float*>(record[3 * kda_layer + part]);
  }
};

// One growable scratch buffer per role, reused across layers.
struct Scratch {
  std::vector<float> a, b, c, d, e, f;
  static float* get(std::vector<float>& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
    return v.data();
  }
};

// kda_index: which of the model's KDA layers (its record entry)
void kda_layer(const Layer& L, const float* x, float* out, int64_t B, const Batch& batch,
               int64_t kda_index, Scratch& s) {
  const int64_t H = L.heads, K = L.head_dim, P = H * K, width = L.in_proj.n;
  float* in = Scratch::get(s.a, B * width);
  linear(L.in_proj, x, in, B);
  // a verify's step inputs go straight into its record (the kernel only reads them)
  float* qkv = batch.record ? batch.recorded(kda_index, 0) : Scratch::get(s.b, B * 3 * P);
  float* low = Scratch::get(s.c, B * K);  // f_a, then g_a
  float* f = batch.record ? batch.recorded(kda_index, 1) : Scratch::get(s.d, B * P);
  float* z = Scratch::get(s.e, B * P);
  float* beta = batch.record ? batch.recorded(kda_index, 2) : Scratch::get(s.f, B * H);
  columns(in, width, 0, 3 * P, qkv, B);
  columns(in, width, 3 * P, K, low, B);
  linear(L.f_b, low, f, B);
  const int64_t gate = L.g_b.w ? K : P;  // g_a, or K3's full-rank gate (z itself)
  if (L.g_b.w) {
    columns(in, width, 3 * P + K, K, low, B);
    linear(L.g_b, low, z, B);
  } else {
    columns(in, width, 3 * P + K, P, z, B);
  }
  columns(in, width, 3 * P + K + gate, H, beta, B);
  float* o = in;  // free again
  kda_decode_f32(qkv, f, beta, z, ptr<float>(L.conv_w), ptr<float>(L.A_log),
                 ptr<float>(L.dt_bias), ptr<float>(L.o_norm), reinterpret_cast<float*>(L.state),
                 reinterpret_cast<float*>(L.conv_state), batch.slots, batch.kda_cu(B), o,
                 batch.kda_cu(B) ? batch.S : B, H, K, K,
                 L.conv_size, static_cast<float>(L.kda_eps),
                 static_cast<float>(L.kda_lower_bound));
  linear(L.kda_o, o, out, B);
}

void mla_layer(const Layer& L, const float* x, float* out, int64_t B, const Batch& batch,
               Scratch& s) {
  const int64_t H = L.mla_heads, R = L.rank, Dr = L.dr, row = R + Dr;
  float* q = Scratch::get(s.a, B * H * (L.dn + Dr));
  if (L.q_a.w) {
    float* qa = Scratch::get(s.d, B * L.q_a.n);
    float* qn = Scratch::get(s.e, B * L.q_a.n);
    linear(L.q_a, x, qa, B);
    rms_norm_f32(qa, L.q_a.n, ptr<float>(L.q_a_norm), qn, B, L.q_a.n,
                 static_cast<float>(L.latent_eps));
    linear(L.q_b, qn, q, B);
  } else {
    linear(L.q_proj, x, q, B);
  }
  float* ckv = Scratch::get(s.b, B * row);
  linear(L.kv_a, x, ckv, B);
  float* cache = reinterpret_cast<float*>(L.kv_cache);
  for (int64_t b = 0; b < B; ++b) {  // the normalised latent and the rope key, into the pool
    float* dst = cache + batch.slot_mapping[b] * row;
    rms_norm_f32(ckv + b * row, row, ptr<float>(L.kv_a_norm), dst, 1, R,
                 static_cast<float>(L.latent_eps));
    std::memcpy(dst + R, ckv + b * row + R, Dr * sizeof(float));
  }
  float* o = Scratch::get(s.c, B * H * L.dv);
  mla_forward_f32(q, H * (L.dn + Dr), ptr<float>(L.kv_b), cache, batch.table, batch.lens,
                  batch.cu, o, batch.S, B, H, L.dn, Dr, L.dv, R, L.block_size,
                  batch.table_width, static_cast<float>(L.mla_scale));
  if (L.mla_gate.w) {  // K3: o * sigmoid(g_proj(x)); q_a's buffers are free again
    float* g = Scratch::get(s.d, B * L.mla_gate.n);
    float* gated = Scratch::get(s.e, B * L.mla_gate.n);
    linear(L.mla_gate, x, g, B);
    sigmoid_mul_f32(o, g, gated, B * L.mla_gate.n);
    o = gated;
  }
  linear(L.mla_o, o, out, B);
}

void mlp(const Layer& L, const Linear& gate_up, const Linear& down, const float* x, float* out,
         int64_t B, Scratch& s) {
  float* gu = Scratch::get(s.a, B * gate_up.n);
  linear(gate_up, x, gu, B);
  float* act = Scratch::get(s.b, B * gate_up.n / 2);
  if (L.act_beta == 0.0)
    silu_mul_f32(gu, act, B, gate_up.n / 2);
  else
    situ_mul_f32(gu, act, B, gate_up.n / 2, static_cast<float>(L.act_beta),
                 static_cast<float>(L.act_linear_beta));
  linear(down, act, out, B);
}

// blocked_from: the per-op forward's choice, so both forwards run an expert's tokens the same
// way (token blocks or split weight rows sum in different orders)
void moe_layer(const Layer& L, const float* x, float* out, int64_t B, int64_t D,
               int64_t blocked_from, Scratch& s) {
  const int64_t E = L.experts, k = L.top_k;
  std::vector<float> logits(B * E), weights(B * k), shared;
  std::vector<int64_t> ids(B * k);
  linear_small_f32(x, ptr<float>(L.router), logits.data(), B, E, D);
  moe_route_f32(logits.data(), L.router_bias ? ptr<float>(L.router_bias) : nullptr,
                weights.data(), ids.data(), B, E, k, L.groups, L.topk_group, L.renormalize,
                L.sigmoid, static_cast<float>(L.routed_scaling));
  // LatentMoE (K3): the experts see and sum the input projected to the latent width
  const float* ex = x;
  float* ey = out;
  int64_t Dx = D;
  if (L.lat_down.w) {
    Dx = L.lat_down.n;
    float* xl = Scratch::get(s.c, B * Dx);
    linear(L.lat_down, x, xl, B);
    ex = xl;
    ey = Scratch::get(s.d, B * Dx);
  }
  const float beta = static_cast<float>(L.act_beta), lbeta = static_cast<float>(L.act_linear_beta);
  if (L.expert_dtype == 1)
    moe_experts_bf16w(ex, ids.data(), weights.data(), ptr<uint16_t>(L.w13), ptr<uint16_t>(L.w2),
                      ey, B, k, E, L.expert_inter, Dx, blocked_from, beta, lbeta);
  else if (L.expert_dtype == 2)
    moe_experts_int8w(ex, ids.data(), weights.data(), ptr<int8_t>(L.w13), ptr<int8_t>(L.w2),
                      ptr<float>(L.s13), ptr<float>(L.s2), ey, B, k, E, L.expert_inter, Dx,
                      blocked_from, beta, lbeta);
  else if (L.expert_dtype == 3)
    moe_experts_mxfp4(ex, ids.data(), weights.data(), ptr<uint8_t>(L.w13), ptr<uint8_t>(L.s13),
                      ptr<uint8_t>(L.w2), ptr<uint8_t>(L.s2), ey, B, k, E, L.expert_inter, Dx,
                      beta, lbeta);
  else
    moe_experts_f32(ex, ids.data(), weights.data(), ptr<float>(L.w13), ptr<float>(L.w2), ey, B,
                    k, E, L.expert_inter, Dx, blocked_from, beta, lbeta);
  if (L.lat_down.w) {  // the latent sum, normed, back to the hidden width
    const float* yl = ey;
    if (L.lat_norm) {
      float* yn = Scratch::get(s.e, B * Dx);
      rms_norm_f32(ey, Dx, ptr<float>(L.lat_norm), yn, B, Dx, static_cast<float>(L.lat_eps));
      yl = yn;
    }
    linear(L.lat_up, yl, out, B);
  }
  if (L.gate_up.w) {
    shared.resize(B * D);
    mlp(L, L.gate_up, L.down, x, shared.data(), B, s);
    add(out, shared.data(), B * D);
  }
}

// The mixer (KDA or MLA) of layer L on its normed input x, into y.
// kda_seen: the model's KDA layers before this one.
void mixer(const Layer& L, const float* x, float* y, int64_t B, const Batch& batch,
           int64_t& kda_seen, Scratch& s) {
  if (L.is_kda)
    kda_layer(L, x, y, B, batch, kda_seen++, s);
  else
    mla_layer(L, x, y, B, batch, s);
}

// A site's effective query [D]: its norm weight times its projection, computed every step as
// AttnResSite.forward does (a weight updated in place needs no new plan).
void site_query(const int64_t site[2], float* w, int64_t D) {
  const float *n = ptr<float>(site[0]), *p = ptr<float>(site[1]);
  for (int64_t d = 0; d < D; ++d) w[d] = n[d] * p[d];
}

// K3's layer loop (models/kimi_linear.py `_attn_res_layers`): each site mixes the bank (the
// embeddings, then each finished block's sum) with the current block's partial sum, fused with
// the RMSNorm after it; a block's first layer banks the partial sum it was handed. partial
// [B, D]: the embeddings in, overwritten; out [B, D]: the final site's normed mix.
void attn_res_layers(const Model* model, const Layer* layers, float* partial, int64_t B,
                     const Batch& batch, const Taps& taps, float* out) {
  const int64_t D = model->hidden, block = model->attn_res_block;
  const float eps = static_cast<float>(model->eps), site_eps = static_cast<float>(model->site_eps);
  std::vector<float> bank(((model->num_layers + block - 1) / block) * B * D), x(B * D),
      y(B * D), w(D);
  int64_t banked = 0;
  bool open = true;  // whether `partial` holds this block's sum so far
  int64_t kda_seen = 0;
  Scratch s;
  for (int64_t i = 0; i < model->num_layers; ++i) {
    const Layer& L = layers[i];
    site_query(L.attn_site, w.data(), D);
    attn_res_norm_f32(bank.data(), banked, partial, w.data(), site_eps,
                      ptr<float>(L.input_norm), eps, x.data(), B, D);
    if (i % block == 0) {
      std::memcpy(bank.data() + banked++ * B * D, partial, B * D * sizeof(float));
      open = false;
    }
    mixer(L, x.data(), y.data(), B, batch, kda_seen, s);
    if (open)
      add(partial, y.data(), B * D);
    else
      std::memcpy(partial, y.data(), B * D * sizeof(float));
    open = true;
    site_query(L.mlp_site, w.data(), D);
    attn_res_norm_f32(bank.data(), banked, partial, w.data(), site_eps,
                      ptr<float>(L.post_norm), eps, x.data(), B, D);
    if (L.is_moe)
      moe_layer(L, x.data(), y.data(), B, D, model->moe_blocked_from, s);
    else
      mlp(L, L.gate_up, L.down, x.data(), y.data(), B, s);
    add(partial, y.data(), B * D);
    const int64_t j = taps.index(i);
    if (j >= 0 && taps.aggregated) {  // what the next site mixes, before its norm
      site_query(i + 1 < model->num_layers ? layers[i + 1].attn_site : model->out_site,
                 w.data(), D);
      attn_res_norm_f32(bank.data(), banked, partial, w.data(), site_eps, nullptr, 0.0f,
                        x.data(), B, D);
      taps.put(j, x.data(), B, D);
    } else if (j >= 0) {
      taps.put(j, partial, B, D);
    }
  }
  site_query(model->out_site, w.data(), D);
  attn_res_norm_f32(bank.data(), banked, partial, w.data(), site_eps,
                    ptr<float>(model->final_norm), eps, out, B, D);
}

}  // namespace

extern "C" {

// B rows of S sequences (struct Batch): ids, slot_mapping [B]; slots, context_lens [S];
// block_table [S, table_width]; cu [S + 1]; out [B, D]: the final-normed hidden states of
// every row (the lm_head runs apart); tap_layers [num_taps] and tapped [B, num_taps * D]: a
// drafter's taps (struct Taps); record (nullable): a verify's step inputs (struct Batch).
void decode_forward_f32(const Model* model, const Layer* layers, const int64_t* ids,
                        const int64_t* slots, const int64_t* block_table, int64_t table_width,
                        const int64_t* context_lens, const int64_t* cu,
                        const int64_t* slot_mapping, float* out, int64_t B, int64_t S,
                        const int64_t* tap_layers, int64_t num_taps, int64_t aggregated,
                        float* tapped, const int64_t* record) {
  const Taps taps{tap_layers, num_taps, aggregated, tapped};
  const Batch batch{S, cu, slots, block_table, table_width, context_lens, slot_mapping, record};
  const int64_t D = model->hidden;
  std::vector<float> h(B * D), x(B * D), y(B * D);
  const float* embed = ptr<float>(model->embed);
  for (int64_t b = 0; b < B; ++b)
    std::memcpy(h.data() + b * D, embed + ids[b] * D, D * sizeof(float));
  if (model->attn_res_block > 0)
    return attn_res_layers(model, layers, h.data(), B, batch, taps, out);
  int64_t kda_seen = 0;
  Scratch s;
  for (int64_t i = 0; i < model->num_layers; ++i) {
    const Layer& L = layers[i];
    rms_norm_f32(h.data(), D, ptr<float>(L.input_norm), x.data(), B, D,
                 static_cast<float>(model->eps));
    mixer(L, x.data(), y.data(), B, batch, kda_seen, s);
    add(h.data(), y.data(), B * D);
    rms_norm_f32(h.data(), D, ptr<float>(L.post_norm), x.data(), B, D,
                 static_cast<float>(model->eps));
    if (L.is_moe)
      moe_layer(L, x.data(), y.data(), B, D, model->moe_blocked_from, s);
    else
      mlp(L, L.gate_up, L.down, x.data(), y.data(), B, s);
    add(h.data(), y.data(), B * D);
    const int64_t j = taps.index(i);
    if (j >= 0) taps.put(j, h.data(), B, D);  // the residual stream
  }
  rms_norm_f32(h.data(), D, ptr<float>(model->final_norm), out, B, D,
               static_cast<float>(model->eps));
}

}  // extern "C"
