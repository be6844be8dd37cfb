"""Plain-torch KDA reference: short conv, gate, recurrent and chunk (WY/UT) forms.

This is the specification the fast backends are tested against (kda_spec.md §1). Packed
variable-length batches: tokens of B sequences concatenated, `cu_seqlens` [B+1] marks them,
`state_slots` [B] names each sequence's row in the state pool, which is updated in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2_EPS = 1e-6
# The chunk form computes the same function for any chunk size (production GPU kernels use 64).
# Here the pairwise-decay tensor costs C^2*K per chunk, so 16-token chunks run ~10x faster in
# plain torch on a CPU than 64 (measured: 1700 tokens x 6 heads x 128, 0.27 s vs 3.2 s).
CHUNK = 16


def kda_gate_ref(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                 lower_bound: float | None = None) -> torch.Tensor:
    """Log-space decay `-exp(A_log[h]) * softplus(g + dt_bias)` (Kimi Linear), or with a
    `lower_bound` K3's `lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias))`, which keeps
    every step's decay in [lower_bound, 0] (fla's naive_kda_lowerbound_gate).
    g: [T, H, K] -> fp32 [T, H, K]."""
    T, H, K = g.shape
    x = g.float() + dt_bias.float().view(H, K)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(torch.exp(A_log.float().view(H, 1)) * x)
    # softplus with PyTorch's threshold 20: identity above, so huge gate logits do not overflow.
    return -torch.exp(A_log.float().view(H, 1)) * F.softplus(x, beta=1.0, threshold=20.0)


def l2norm_ref(x: torch.Tensor) -> torch.Tensor:
    """fla's l2norm: eps is added to the sum of squares (not a clamp like F.normalize)."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def _activate(q, k, g, beta, A_log, dt_bias, lower_bound=None):
    gate = kda_gate_ref(g, A_log, dt_bias, lower_bound)
    return l2norm_ref(q), l2norm_ref(k), gate, torch.sigmoid(beta.float())


def _pad(x: torch.Tensor, cu: list[int], length: int) -> torch.Tensor:
    """[T, ...] packed -> [B, length, ...], zeros at each sequence's end.

    End-padding with q=k=v=0, g=0, beta=0 leaves outputs and final states unchanged (spec §1.3).
    """
    B = len(cu) - 1
    out = x.new_zeros(B, length, *x.shape[1:])
    for b in range(B):
        out[b, : cu[b + 1] - cu[b]] = x[cu[b] : cu[b + 1]]
    return out


def _unpad(x: torch.Tensor, cu: list[int]) -> torch.Tensor:
    return torch.cat([x[b, : cu[b + 1] - cu[b]] for b in range(len(cu) - 1)])


def kda_recurrent_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                      state: torch.Tensor, state_slots: torch.Tensor,
                      cu_seqlens: torch.Tensor, lower_bound: float | None = None,
                      ) -> torch.Tensor:
    """Token-by-token delta rule.

    q, k: [T, H, K] post-conv; v: [T, H, V]; g: [T, H, K] raw gate (before dt_bias/softplus);
    beta: [T, H] logits; state: [N, H, K, V] fp32 pool; returns o: [T, H, V] in v.dtype.
    `lower_bound`: K3's gate (see kda_gate_ref).
    """
    cu = cu_seqlens.tolist()
    q, k, g, beta = _activate(q, k, g, beta, A_log, dt_bias, lower_bound)
    Tm = max(cu[i + 1] - cu[i] for i in range(len(cu) - 1))
    qp, kp, vp, gp, bp = (_pad(x, cu, Tm) for x in (q, k, v.float(), g, beta))
    scale = q.shape[-1] ** -0.5
    S = state[state_slots].float()  # [B, H, K, V]
    out = torch.zeros_like(vp)
    for t in range(Tm):
        S = S * gp[:, t].exp().unsqueeze(-1)
        kt = kp[:, t]
        pred = torch.einsum("bhk,bhkv->bhv", kt, S)
        delta = (vp[:, t] - pred) * bp[:, t].unsqueeze(-1)
        S = S + kt.unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, t] = torch.einsum("bhk,bhkv->bhv", qp[:, t] * scale, S)
    state[state_slots] = S.to(state.dtype)
    return _unpad(out, cu).to(v.dtype)


Snapshots = tuple[torch.Tensor, torch.Tensor]


def kda_chunk_in_segments(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          g: torch.Tensor, beta: torch.Tensor, A_log: torch.Tensor,
                          dt_bias: torch.Tensor, state: torch.Tensor, state_slots: torch.Tensor,
                          cu_seqlens: torch.Tensor, snapshots: Snapshots,
                          **gate: float | None) -> torch.Tensor:
    """`kda_chunk` with snapshots for a backend whose kernel cannot emit them: sequences
    without a snapshot row run in one call; each one with snapshots runs segment by segment,
    its state copied to the snapshot slot after each segment that ends on a snapshot row."""
    rows, dst = snapshots
    cu = cu_seqlens.tolist()
    snap = dict(zip(rows.tolist(), dst.tolist(), strict=True))
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=v.dtype, device=v.device)
    args = (q, k, v, g, beta)
    plain = [b for b in range(len(cu) - 1) if not any(cu[b] <= r < cu[b + 1] for r in snap)]
    if plain:
        idx = torch.cat([torch.arange(cu[b], cu[b + 1]) for b in plain]).to(q.device)
        lens = torch.tensor([0] + [cu[b + 1] - cu[b] for b in plain]).cumsum(0)
        out[idx] = fn(*(a[idx] for a in args), A_log, dt_bias, state, state_slots[plain],
                      lens.to(cu_seqlens.device), **gate)
    for b in (b for b in range(len(cu) - 1) if b not in plain):
        cuts = sorted(r + 1 for r in snap if cu[b] <= r < cu[b + 1] - 1) + [cu[b + 1]]
        start = cu[b]
        for end in cuts:
            one = torch.tensor([0, end - start], device=cu_seqlens.device)
            out[start:end] = fn(*(a[start:end] for a in args), A_log, dt_bias, state,
                                state_slots[b:b + 1], one, **gate)
            if end - 1 in snap:
                state[snap[end - 1]] = state[state_slots[b]]
            start = end
    return out


def kda_chunk_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                  state: torch.Tensor, state_slots: torch.Tensor, cu_seqlens: torch.Tensor,
                  snapshots: Snapshots | None = None,
                  lower_bound: float | None = None) -> torch.Tensor:
    """Chunked (WY / UT-transform) form, CHUNK-token chunks; same contract as
    `kda_recurrent_ref`, plus `snapshots = (rows, slots)`: the state of a sequence right
    after its token at packed row rows[i] is also written to pool row slots[i] (the prefix
    cache's snapshots, taken inside a prefill chunk instead of cutting the chunk there)."""
    if snapshots is not None and snapshots[0].numel():
        return kda_chunk_in_segments(kda_chunk_ref, q, k, v, g, beta, A_log, dt_bias, state,
                                     state_slots, cu_seqlens, snapshots,
                                     lower_bound=lower_bound)
    cu = cu_seqlens.tolist()
    q, k, g, beta = _activate(q, k, g, beta, A_log, dt_bias, lower_bound)
    Tm = max(cu[i + 1] - cu[i] for i in range(len(cu) - 1))
    Tp = -(-Tm // CHUNK) * CHUNK
    # [B, H, T, *] layout, so each chunk is a batch of [C, K] matrices per (sequence, head)
    qp, kp, vp, gp = (_pad(x, cu, Tp).transpose(1, 2) for x in (q, k, v.float(), g))
    bp = _pad(beta, cu, Tp).transpose(1, 2)
    qp = qp * q.shape[-1] ** -0.5
    S = state[state_slots].float()
    out = torch.zeros_like(vp)
    C = CHUNK
    eye = torch.eye(C, device=q.device)
    incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = incl.clone().fill_diagonal_(False)
    lens = torch.tensor([cu[i + 1] - cu[i] for i in range(len(cu) - 1)], device=q.device)
    for s in range(0, Tp, C):
        # only sequences with tokens in this chunk: a ragged batch (say one long prefill and
        # many one-token decodes) must not cost batch x longest
        act = (lens > s).nonzero().squeeze(1)
        qc, kc, vc, bc = (x[act, :, s:s + C] for x in (qp, kp, vp, bp))
        G = gp[act, :, s:s + C].cumsum(2)  # Γ_r, [B, H, C, K]
        # Γ_r - Γ_i is ≤ 0 for r ≥ i: exponentiate the difference, never exp(Γ_r)·exp(-Γ_i),
        # which overflows for strong decay. Entries above the diagonal are masked before exp.
        diff = G.unsqueeze(3) - G.unsqueeze(2)  # [B, H, C(r), C(i), K]
        decay = diff.masked_fill(~incl[:, :, None], float("-inf")).exp()
        kk = torch.einsum("bhrk,bhik,bhrik->bhri", kc, kc, decay)
        L = (kk * bc.unsqueeze(-1)).masked_fill(~strict, 0.0)
        # M = (I + L)^-1 Diag(beta): unit-lower-triangular solve
        M = torch.linalg.solve_triangular(eye + L, torch.diag_embed(bc), upper=False,
                                          unitriangular=True)
        gamma = G.exp()
        Wm = M @ (gamma * kc)
        U = M @ vc
        Sa = S[act]
        Vp = U - Wm @ Sa
        Aqk = torch.einsum("bhrk,bhik,bhrik->bhri", qc, kc, decay)
        out[act, :, s:s + C] = (qc * gamma) @ Sa + Aqk @ Vp
        G_last = G[:, :, -1:]  # [B, H, 1, K]
        S[act] = Sa * G_last.squeeze(2).exp().unsqueeze(-1) + \
            (kc * (G_last - G).exp()).transpose(-1, -2) @ Vp
    state[state_slots] = S.to(state.dtype)
    return _unpad(out.transpose(1, 2), cu).to(v.dtype)


def gated_rmsnorm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """fla's FusedRMSNormGated with sigmoid gate, all in fp32: w * o / rms(o) * sigmoid(gate).

    o, gate: [T, H, V]; weight: [V] shared by all heads.
    """
    of = o.float()
    of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * of * torch.sigmoid(gate.float())).to(o.dtype)


def kda_decode_ref(qkv: torch.Tensor, f: torch.Tensor, beta: torch.Tensor, z: torch.Tensor,
                   conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                   norm_weight: torch.Tensor, eps: float, state: torch.Tensor,
                   conv_state: torch.Tensor, state_slots: torch.Tensor,
                   cu_seqlens: torch.Tensor | None = None,
                   lower_bound: float | None = None) -> torch.Tensor:
    """A whole KDA step for B sequences between the projections: short conv of the
    concatenated q|k|v, delta rule, gated RMSNorm.

    qkv: [T, 2HK + HV] pre-conv projections; f: [T, H, K] raw gate; beta: [T, H] logits;
    z: [T, H, V] output gate; conv_weight: [2HK + HV, W]; norm_weight: [V]; state and
    conv_state: this layer's pools (updated in place). cu_seqlens [B+1]: a few tokens per
    sequence, token by token (a verify, or its replay); None: one token each (T = B).
    Returns [T, H, V] in qkv.dtype.
    """
    return compose_kda_decode(short_conv_ref, kda_recurrent_ref, qkv, f, beta, z, conv_weight,
                              A_log, dt_bias, norm_weight, eps, state, conv_state, state_slots,
                              cu_seqlens, lower_bound=lower_bound)


def compose_kda_decode(short_conv, kda_recurrent, qkv: torch.Tensor, f: torch.Tensor,
                       beta: torch.Tensor, z: torch.Tensor, conv_weight: torch.Tensor,
                       A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor,
                       eps: float, state: torch.Tensor, conv_state: torch.Tensor,
                       state_slots: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                       **gate: float | None) -> torch.Tensor:
    """`kda_decode` out of a backend's `short_conv` and `kda_recurrent` ops (`gate`: the
    recurrent op's gate keywords, passed on)."""
    T, H, K = f.shape
    cu = torch.arange(T + 1, device=qkv.device) if cu_seqlens is None else cu_seqlens
    x = short_conv(qkv, conv_weight, conv_state, state_slots, cu)
    q, k, v = x[:, :H * K].view(T, H, K), x[:, H * K:2 * H * K].view(T, H, K), \
        x[:, 2 * H * K:].view(T, H, -1)
    o = kda_recurrent(q, k, v, f, beta, A_log, dt_bias, state, state_slots, cu, **gate)
    return gated_rmsnorm(o, z, norm_weight, eps)


def short_conv_ref(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                   state_slots: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv + SiLU over packed sequences, continuing from and updating the cache.

    x: [T, D] pre-conv projections; weight: [D, W] (tap W-1 multiplies the current token);
    conv_state: [N, W-1, D] pool of the last W-1 pre-conv inputs per slot (oldest first).
    Returns SiLU(conv) [T, D] in x.dtype; computed in fp32.
    """
    cu = cu_seqlens.tolist()
    D, W = weight.shape
    out = torch.empty_like(x)
    w = weight.float().t()  # [W, D]
    for b in range(len(cu) - 1):
        slot = int(state_slots[b])
        xs = x[cu[b] : cu[b + 1]]
        n = xs.shape[0]
        window = torch.cat([conv_state[slot].to(x.dtype), xs])  # [W-1+n, D]
        wf = window.float()
        y = sum(wf[j : j + n] * w[j] for j in range(W))
        out[cu[b] : cu[b + 1]] = F.silu(y).to(x.dtype)
        conv_state[slot] = window[-(W - 1):].to(conv_state.dtype)
    return out
