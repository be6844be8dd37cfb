"""Kimi Linear and Kimi K3's text model: KDA and MLA token mixers interleaved, dense/MoE
feed-forward, one forward over a packed `ForwardBatch`.

K3 (k3_spec.md 4) is the same skeleton with Attention Residuals in place of the residual
stream, SiTU-GLU, LatentMoE, the lower-bounded KDA gate with a full-rank output gate and a gated
q-LoRA MLA: each is a config field read by the layers, so one class serves both; its checkpoint
names carry the `language_model.` prefix of `KimiK3ForConditionalGeneration`."""

from __future__ import annotations

import torch
from torch import nn

from kdaserve.cache.block_pool import BlockPool
from kdaserve.cache.state_pool import StatePool
from kdaserve.config import KDA, MOE, ModelConfig
from kdaserve.forward_batch import ForwardBatch
from kdaserve.kernels import Kernels
from kdaserve.layers.attn_res import AttnResSite, Bank
from kdaserve.layers.kda import KDAttention
from kdaserve.layers.linear import Linear
from kdaserve.layers.mla import MLAttention
from kdaserve.layers.moe import MLP, MoE, situ_of
from kdaserve.layers.norm import RMSNorm
from kdaserve.layers.parallel import (
    SINGLE,
    SINGLE_EP,
    Destination,
    ExpertParallel,
    TensorParallel,
)
from kdaserve.step_record import KDASteps, StepRecord


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, idx: int, kernels: Kernels,
                 tp: TensorParallel = SINGLE, ep: ExpertParallel = SINGLE_EP) -> None:
        super().__init__()
        self.is_kda = config.layer_types[idx] == KDA
        self.self_attn: KDAttention | MLAttention = (
            KDAttention(config, kernels, tp) if self.is_kda else MLAttention(config, kernels, tp)
        )
        self.is_moe = config.mlp_types[idx] == MOE
        self.mlp: MoE | MLP = (
            MoE(config, kernels, tp, ep) if self.is_moe
            else MLP(config.hidden_size, config.intermediate_size, kernels, tp, situ_of(config))
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        # AttnRes (K3): the mixing sites before the attention and before the MLP
        self.attn_res: AttnResSite | None = None
        self.mlp_res: AttnResSite | None = None
        if config.attn_res_block_size is not None:
            self.attn_res = AttnResSite(config.hidden_size, config.rms_norm_eps, kernels)
            self.mlp_res = AttnResSite(config.hidden_size, config.rms_norm_eps, kernels)

    def checkpoint_tensors(self, prefix: str) -> dict[str, Destination | None]:
        views: dict[str, Destination | None] = {
            **self.self_attn.checkpoint_tensors(prefix + "self_attn.")}
        if isinstance(self.mlp, MoE):
            views.update(self.mlp.checkpoint_tensors(prefix + "block_sparse_moe."))
        else:
            views.update(self.mlp.checkpoint_tensors(prefix + "mlp."))
        views[prefix + "input_layernorm.weight"] = self.input_layernorm.weight
        views[prefix + "post_attention_layernorm.weight"] = self.post_attention_layernorm.weight
        if self.attn_res is not None and self.mlp_res is not None:
            views.update(self.attn_res.checkpoint_tensors(prefix + "self_attention_res"))
            views.update(self.mlp_res.checkpoint_tensors(prefix + "mlp_res"))
        return views


class KimiLinearForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels,
                 tp: TensorParallel = SINGLE, ep: ExpertParallel = SINGLE_EP) -> None:
        super().__init__()
        self.config, self.tp, self.ep = config, tp, ep
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, kernels, tp, ep)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.lm_head = None if config.tie_word_embeddings else Linear(
            config.hidden_size, config.vocab_size, kernels)
        self.output_attn_res = AttnResSite(config.hidden_size, config.rms_norm_eps, kernels) \
            if config.attn_res_block_size is not None else None
        self.kernels = kernels
        # layer index -> row in the state pool (KDA) or block pool (MLA)
        self.cache_index = {}
        for kind_layers in (config.kda_layers, config.mla_layers):
            self.cache_index.update({layer: j for j, layer in enumerate(kind_layers)})

    def checkpoint_tensors(self) -> dict[str, Destination | None]:
        """Checkpoint tensor name (Moonshot's hub names) -> destination parameter view (a
        `Shard` of it where a tensor-parallel rank holds a slice)."""
        views: dict[str, Destination | None] = {
            "model.embed_tokens.weight": self.embed_tokens.weight,
                 "model.norm.weight": self.norm.weight}
        if self.lm_head is not None:
            views["lm_head.weight"] = self.lm_head.weight
        if self.output_attn_res is not None:
            views.update(self.output_attn_res.checkpoint_tensors("model.output_attn_res"))
        for i, layer in enumerate(self.layers):
            views.update(layer.checkpoint_tensors(f"model.layers.{i}."))
        prefix = self.config.tensor_prefix
        return {prefix + name: dest for name, dest in views.items()} if prefix else views

    def transformers_tensors(self) -> dict[str, torch.Tensor]:
        """transformers' `KimiLinearForCausalLM` parameter names -> destination views, for the
        names that differ from the checkpoint's: an RL trainer holding that module sends its
        `named_parameters()` (fused q|k|v conv, the forget gate's own module, experts fused
        per layer as gate_up_proj [E, 2I, D] and down_proj [E, D, I], MoE under `mlp.`)."""
        if self.tp.size > 1 or self.ep.size > 1:
            raise ValueError("updates by transformers' names are not supported with tensor "
                             "or expert parallelism")
        if self.config.tensor_prefix:
            raise ValueError("transformers has no K3 model whose names an update could use")
        ck: dict[str, torch.Tensor] = self.checkpoint_tensors()  # type: ignore[assignment]
        views: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            if isinstance(attn, KDAttention):
                C, W = attn.conv_weight.shape
                views[p + "self_attn.conv1d.weight"] = attn.conv_weight.data.view(C, 1, W)
                for name in ("dt_bias", "A_log", "f_a_proj.weight", "f_b_proj.weight"):
                    views[p + "self_attn.forget_gate." + name] = ck[p + "self_attn." + name]
            if isinstance(mlp, MoE):
                views[p + "mlp.experts.gate_up_proj"], views[p + "mlp.experts.down_proj"] = \
                    mlp.routed_weights()
                views[p + "mlp.gate.weight"] = mlp.gate_weight
                views[p + "mlp.gate.e_score_correction_bias"] = mlp.e_score_correction_bias
                shared = p + "block_sparse_moe.shared_experts."
                views.update({p + "mlp.shared_experts." + k.removeprefix(shared): v
                              for k, v in ck.items() if k.startswith(shared)})
        return views

    def forward(self, batch: ForwardBatch, states: StatePool, blocks: BlockPool) -> torch.Tensor:
        """Runs the new tokens of every sequence; returns fp32 logits [L, vocab] for the rows in
        `batch.logits_indices`. Caches are read and updated in place."""
        return self.compute_logits(self.forward_hidden(batch, states, blocks))

    def forward_hidden(self, batch: ForwardBatch, states: StatePool,
                       blocks: BlockPool) -> torch.Tensor:
        """As `forward`, but returns the final-normed hidden states [L, D] of the logits rows
        (what the LM head sees; block drafters condition on them). With `batch.taps`, the
        rows after those layers also go to `batch.tapped`."""
        h = self.embed_tokens(batch.input_ids)
        if batch.embed_rows is not None:  # images' rows at their pads
            index, rows = batch.embed_rows
            h = h.index_copy(0, index, rows.to(h.dtype))
        tapped: list[torch.Tensor] = []
        if self.output_attn_res is not None:
            h = self._attn_res_layers(h, batch, states, blocks, tapped)
        else:
            for i, layer in enumerate(self.layers):
                h = h + self._mixer(i, layer.input_layernorm(h), batch, states, blocks)
                h = h + self._ffn(i, layer.post_attention_layernorm(h), batch)
                if i in batch.taps:
                    tapped.append(h if batch.tap_all_rows else h[batch.logits_indices])
            h = self.norm(h[batch.logits_indices])
        if tapped:
            batch.tapped = torch.cat(tapped, dim=-1)
        return h

    def _mixer(self, i: int, x: torch.Tensor, batch: ForwardBatch, states: StatePool,
               blocks: BlockPool) -> torch.Tensor:
        """Layer i's KDA or MLA on its normed input (summed over tensor-parallel ranks:
        row-parallel outputs are partial sums)."""
        layer, j = self.layers[i], self.cache_index[i]
        if layer.is_kda:
            x = layer.self_attn(x, batch, states.recurrent[j], states.conv[j])
        else:
            x = layer.self_attn(x, batch, blocks.kv[j])
        return self.tp.all_reduce(x)

    def _ffn(self, i: int, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        layer = self.layers[i]
        x = layer.mlp(x, batch.routing) if layer.is_moe else layer.mlp(x)
        return self.tp.all_reduce(x)

    def _attn_res_layers(self, h: torch.Tensor, batch: ForwardBatch, states: StatePool,
                         blocks: BlockPool, tapped: list[torch.Tensor]) -> torch.Tensor:
        """K3's layer loop (k3_spec.md 4.2): each site mixes the bank and the current block's
        partial sum; a block's first layer banks the partial sum it was handed (layer 0: the
        embeddings) and starts a new one. Taps read the partial sums. Returns the final norm
        of the output site's mix, for the logits rows."""
        assert self.output_attn_res is not None and self.config.attn_res_block_size
        bank = Bank(len(self.layers), self.config.attn_res_block_size, h)
        partial: torch.Tensor | None = h
        for i, layer in enumerate(self.layers):
            assert layer.attn_res is not None and layer.mlp_res is not None and partial is not None
            x = layer.attn_res(bank.filled(), partial, layer.input_layernorm)
            if bank.starts_block(i):
                bank.push(partial)
                partial = None
            a = self._mixer(i, x, batch, states, blocks)
            partial = a if partial is None else partial + a
            x = layer.mlp_res(bank.filled(), partial, layer.post_attention_layernorm)
            partial = partial + self._ffn(i, x, batch)
            if i in batch.taps:
                tapped.append(self._tap(i, bank, partial, batch))
        assert partial is not None
        rows = batch.logits_indices
        return self.output_attn_res(bank.filled()[:, rows], partial[rows], self.norm)

    def _tap(self, i: int, bank: Bank, partial: torch.Tensor,
             batch: ForwardBatch) -> torch.Tensor:
        """Layer i's tap (`ForwardBatch.tap_stream`) at the batch's tapped rows: the bank and
        partial sum after layer i are what layer i + 1's attention-side site mixes."""
        rows = slice(None) if batch.tap_all_rows else batch.logits_indices
        if batch.tap_stream == "partial":
            return partial[rows]
        site = self.layers[i + 1].attn_res if i + 1 < len(self.layers) else self.output_attn_res
        assert site is not None
        return site.mix(bank.filled()[:, rows], partial[rows])

    def idle_forward(self) -> None:
        """An expert-parallel rank with no tokens this step: only the MoE layers'
        collectives, in the order the other ranks' forwards reach them."""
        empty = self.embed_tokens.weight.new_zeros(0, self.config.hidden_size)
        for layer in self.layers:
            if layer.is_moe:
                layer.mlp(empty)

    def replay_kda(self, record: StepRecord, rows: torch.Tensor, cu_seqlens: torch.Tensor,
                   state_slots: torch.Tensor, states: StatePool) -> None:
        """Advances every KDA layer's states of `state_slots` by the recorded steps `rows`
        (packed by `cu_seqlens`); nothing else runs (MLA needs no rollback)."""
        kda = [i for i, layer in enumerate(self.layers) if layer.is_kda]
        assert len(kda) == len(record.layers), "record is not from this model's forward"
        for i, steps in zip(kda, record.layers, strict=True):
            attn = self.layers[i].self_attn
            assert isinstance(attn, KDAttention)
            j = self.cache_index[i]
            attn.replay_steps(KDASteps(*(t.index_select(0, rows) for t in steps)), cu_seqlens,
                              state_slots, states.recurrent[j], states.conv[j])

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """[L, D] final hidden states -> fp32 logits [L, vocab]."""
        if self.lm_head is None:
            return self.kernels.linear(h, self.embed_tokens.weight).float()
        return self.lm_head(h).float()
