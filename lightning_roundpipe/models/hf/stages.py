"""The pipeline stages a Hugging Face causal LM is cut into: embedding, decoder blocks (whole or halved), head."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_roundpipe.models.hf.attention import _attention_inputs
from lightning_roundpipe.models.hf.families import Family, Norms
from lightning_roundpipe.models.hf.labels import head_loss
from lightning_roundpipe.models.hf.packed import attention_kwargs
from lightning_roundpipe.models.hf.router import _add_router_sums, _router_of, _RouterLogits, load_balancing
from lightning_roundpipe.models.hf.state import State
from lightning_roundpipe.models.tiling import tiled


class InputStage(nn.Module):
    """Token embedding (times the family's multiplier); the rest of the batch passes through; router sums
    start at zero."""

    def __init__(self, embed_tokens: nn.Module, num_experts: int = 0, multiplier: float | None = None) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.num_experts = num_experts
        """Non-zero when the model's load-balancing loss is computed (``output_router_logits``)."""
        self.multiplier = multiplier

    def forward(self, batch: tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]) -> State:
        input_ids, attention_mask, position_ids, labels = batch
        hidden = self.embed_tokens(input_ids)
        if self.multiplier is not None:
            hidden = hidden * self.multiplier
        sums = None
        if self.num_experts:
            zeros = torch.zeros(self.num_experts, dtype=torch.float32, device=hidden.device)
            sums = (zeros, zeros.clone(), torch.zeros((), dtype=torch.float32, device=hidden.device))
        return hidden, attention_mask, position_ids, labels, sums

    def compile_targets(self) -> tuple[nn.Module, ...]:
        """Nothing of the embedding is compiled (``RoundPipeStrategy(compile=...)``): one lookup."""
        return ()


class DecoderStage(nn.Module):
    """One decoder block with its attention mask and rotary tables (made by a stage's first block for each
    micro-batch, shared by the others); for a mixture-of-experts block, its router logits are added to the
    running router sums."""

    def __init__(self, layer: nn.Module, rotary_emb: nn.Module, config: Any, index: int, family: Family) -> None:
        super().__init__()
        self.layer = layer
        self.rotary_emb = rotary_emb
        self.config = config
        self.sliding = family.sliding(config, index)
        self.layer_type = family.layer_type(config, index)
        self.router = family.router

    def compile_targets(self) -> tuple[nn.Module, ...]:
        """The block is compiled; the attention inputs stay eager (they are shared between blocks), and a
        mixture-of-experts block stays eager (its router logits are taken by a hook)."""
        return () if self.router else (self.layer,)

    def forward(self, state: State) -> State:
        hidden, attention_mask, position_ids, labels, sums = state
        mask, positions, rotary = _attention_inputs(self.config, self.sliding, self.rotary_emb, state, self.layer_type)
        router = _router_of(getattr(self.layer, "mlp", None), self.router) if sums is not None else None
        packed = attention_kwargs(self, attention_mask, hidden.shape[1])
        with _RouterLogits(router) as logits:
            out = self.layer(hidden, attention_mask=mask, position_ids=positions, position_embeddings=rotary, **packed)
        if logits:
            assert sums is not None
            sums = _add_router_sums(sums, logits[0], attention_mask, self.config.num_experts_per_tok)
        return (out[0] if isinstance(out, tuple) else out), attention_mask, position_ids, labels, sums


class _Half(nn.Module):
    """Half a decoder block as a layer of its own: ``h + m * dropout(after(part(before(h))))``, with the
    norms, dropout and multiplier ``m`` the family's entry names (``split_decoder_layers``); the two halves
    in a row are the block's arithmetic. ``tile_tokens``: the token-wise work runs over at most this many
    tokens at a time, keeping only its input (:func:`~lightning_roundpipe.models.tiling.tiled`)."""

    part_name = ""

    def __init__(
        self, layer: nn.Module, config: Any, norms: Norms, dropout: str | None, multiplier: float | None,
        tile_tokens: int | None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.before, self.after = norms
        for name in (*norms, dropout):
            if name is not None:
                self.add_module(name, getattr(layer, name))
        self.add_module(self.part_name, getattr(layer, self.part_name))
        self.dropout, self.multiplier = dropout, multiplier
        self.config = config
        self.tile_tokens = tile_tokens

    def _norm(self, name: str | None, x: Tensor) -> Tensor:
        return x if name is None else getattr(self, name)(x)

    def _branch(self, out: Tensor, normed: bool = False) -> Tensor:
        """The branch added to the residual: its norm after (unless ``normed``), dropout, multiplier."""
        out = out if normed else self._norm(self.after, out)
        if self.dropout is not None:
            out = getattr(self, self.dropout)(out)
        return out if self.multiplier is None else out * self.multiplier


class AttentionStage(_Half):
    """The attention half of a decoder block. Its norm before the attention is tiled over tokens; norms
    inside the attention module (q/k norms) run in transformers' code, untiled."""

    part_name = "self_attn"

    def __init__(
        self, layer: nn.Module, rotary_emb: nn.Module, config: Any, index: int, family: Family,
        tile_tokens: int | None = None,
    ) -> None:  # fmt: skip
        dropout = family.residual_dropout[0] if family.residual_dropout else None
        multiplier = family.multiplier(config, family.residual_multiplier)
        super().__init__(layer, config, family.halves[0], dropout, multiplier, tile_tokens)
        self.rotary_emb = rotary_emb
        self.sliding = family.sliding(config, index)
        self.layer_type = family.layer_type(config, index)

    def compile_targets(self) -> tuple[nn.Module, ...]:
        return (self.self_attn,)

    def forward(self, state: State) -> State:
        hidden, attention_mask, position_ids, labels, sums = state
        mask, positions, rotary = _attention_inputs(self.config, self.sliding, self.rotary_emb, state, self.layer_type)
        norm = getattr(self, self.before) if self.before is not None else None
        x = hidden if norm is None else tiled(norm, norm, hidden, self.tile_tokens)
        packed = attention_kwargs(self, attention_mask, hidden.shape[1])
        out = self.self_attn(
            hidden_states=x, attention_mask=mask, position_ids=positions, position_embeddings=rotary, **packed
        )
        return hidden + self._branch(out[0]), attention_mask, position_ids, labels, sums


class MlpStage(_Half):
    """The MLP half of a decoder block, router sums included; its norms and MLP run over tiles of tokens."""

    part_name = "mlp"

    def __init__(self, layer: nn.Module, config: Any, family: Family, tile_tokens: int | None = None) -> None:
        dropout = family.residual_dropout[1] if family.residual_dropout else None
        multiplier = family.multiplier(config, family.residual_multiplier)
        super().__init__(layer, config, family.halves[1], dropout, multiplier, tile_tokens)
        self.router = family.router

    def compile_targets(self) -> tuple[nn.Module, ...]:
        return () if self.router else (self.mlp,)

    def _norm_mlp(self, hidden: Tensor) -> Tensor:
        out = self.mlp(self._norm(self.before, hidden))
        return self._norm(self.after, out[0] if isinstance(out, tuple) else out)

    def forward(self, state: State) -> State:
        hidden, attention_mask, position_ids, labels, sums = state
        router = _router_of(self.mlp, self.router) if sums is not None else None
        if router is not None and self.tile_tokens is not None:
            raise ValueError(
                "tile_tokens cannot tile a mixture-of-experts MLP while its router logits are collected"
                " (output_router_logits=True): the load-balancing loss needs them whole"
            )
        with _RouterLogits(router) as logits:
            out = tiled(self, self._norm_mlp, hidden, self.tile_tokens)  # the norm after included: token-wise
        out = self._branch(out, normed=True)
        if logits:
            assert sums is not None
            sums = _add_router_sums(sums, logits[0], attention_mask, self.config.num_experts_per_tok)
        return hidden + out, attention_mask, position_ids, labels, sums


class OutputStage(nn.Module):
    """Final norm, LM head and the loss Hugging Face computes: next-token cross-entropy, labels shifted
    by one, ``-100`` ignored, mean over the counted tokens, in chunks (never full-vocabulary logits);
    plus ``router_aux_loss_coef`` times the load-balancing loss when router sums travelled."""

    def __init__(
        self, norm: nn.Module, lm_head: nn.Linear, chunk_size: int = 2048, aux_coef: float = 0.0,
        divisor: float | None = None, softcap: float | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        if getattr(lm_head, "bias", None) is not None:
            raise ValueError("the chunked LM-head loss supports heads without bias only")
        self.norm = norm
        self.lm_head = lm_head
        self.chunk_size = chunk_size
        self.aux_coef = aux_coef
        self.divisor = divisor
        """The logits are divided by it (Granite's ``logits_scaling``): the hidden states are, before the head."""
        self.softcap = softcap
        """The logits become ``softcap * tanh(logits / softcap)`` (Gemma's final soft cap)."""
        self.fused_loss = False
        """Liger's fused linear cross-entropy on CUDA tensors (:mod:`.kernels`), instead of the chunked loss."""

    def compile_targets(self) -> tuple[nn.Module, ...]:
        """The head's loss runs its own chunked or fused kernels: nothing here is compiled."""
        return ()

    def forward(self, state: State) -> Tensor:
        hidden, _, _, labels, sums = state
        if labels is None:
            raise ValueError("training through roundpipe needs `labels` in the batch (the loss is computed there)")
        hidden = self.norm(hidden)
        if self.divisor is not None:
            hidden = hidden / self.divisor
        loss = head_loss(hidden, self.lm_head.weight, labels, self.fused_loss, self.chunk_size, self.softcap)
        return loss if sums is None else loss + self.aux_coef * load_balancing(sums)
