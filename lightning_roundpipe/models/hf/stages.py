"""The pipeline stages a Hugging Face causal LM is cut into: embedding, decoder blocks (whole or halved), head."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_roundpipe.models.chunked_loss import chunked_linear_cross_entropy
from lightning_roundpipe.models.hf.attention import _attention_inputs, _sliding
from lightning_roundpipe.models.hf.kernels import fused_linear_cross_entropy
from lightning_roundpipe.models.hf.labels import IGNORE_INDEX, shift_labels
from lightning_roundpipe.models.hf.router import _add_router_sums, _router_of, _RouterLogits
from lightning_roundpipe.models.hf.state import State
from lightning_roundpipe.models.tiling import tiled


class InputStage(nn.Module):
    """Token embedding; the rest of the batch passes through; router sums start at zero."""

    def __init__(self, embed_tokens: nn.Module, num_experts: int = 0) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.num_experts = num_experts
        """Non-zero when the model's load-balancing loss is computed (``output_router_logits``)."""

    def forward(self, batch: tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]) -> State:
        input_ids, attention_mask, position_ids, labels = batch
        hidden = self.embed_tokens(input_ids)
        sums = None
        if self.num_experts:
            zeros = torch.zeros(self.num_experts, dtype=torch.float32, device=hidden.device)
            sums = (zeros, zeros.clone(), torch.zeros((), dtype=torch.float32, device=hidden.device))
        return hidden, attention_mask, position_ids, labels, sums


class DecoderStage(nn.Module):
    """One decoder block with its attention mask and rotary tables made here, per micro-batch; for a
    mixture-of-experts block, its router logits are added to the running router sums."""

    def __init__(self, layer: nn.Module, rotary_emb: nn.Module, config: Any, index: int) -> None:
        super().__init__()
        self.layer = layer
        self.rotary_emb = rotary_emb
        self.config = config
        self.sliding = _sliding(config, index)

    def forward(self, state: State) -> State:
        hidden, attention_mask, position_ids, labels, sums = state
        mask, positions, rotary = _attention_inputs(self.config, self.sliding, self.rotary_emb, state)
        router = _router_of(getattr(self.layer, "mlp", None)) if sums is not None else None
        with _RouterLogits(router) as logits:
            out = self.layer(hidden, attention_mask=mask, position_ids=positions, position_embeddings=rotary)
        if logits:
            assert sums is not None
            sums = _add_router_sums(sums, logits[0], attention_mask, self.config.num_experts_per_tok)
        return (out[0] if isinstance(out, tuple) else out), attention_mask, position_ids, labels, sums


class AttentionStage(nn.Module):
    """The first half of a decoder block as a layer of its own: ``h + self_attn(input_layernorm(h))``.
    With :class:`MlpStage` after it, the same arithmetic as the block (``split_decoder_layers``).

    ``tile_tokens``: the input norm over at most this many tokens at a time, keeping only its input (its
    fp32 intermediates are 8 of the 47 KiB per token this half keeps on a Qwen3-1.7B-shaped model,
    bf16). The norms inside the attention module (Qwen3's q/k norms) run in transformers' code, untiled."""

    def __init__(
        self, layer: nn.Module, rotary_emb: nn.Module, config: Any, index: int, tile_tokens: int | None = None
    ) -> None:
        super().__init__()
        self.input_layernorm = layer.input_layernorm
        self.self_attn = layer.self_attn
        self.rotary_emb = rotary_emb
        self.config = config
        self.sliding = _sliding(config, index)
        self.tile_tokens = tile_tokens

    def forward(self, state: State) -> State:
        hidden, attention_mask, position_ids, labels, sums = state
        mask, positions, rotary = _attention_inputs(self.config, self.sliding, self.rotary_emb, state)
        out = self.self_attn(
            hidden_states=tiled(self.input_layernorm, self.input_layernorm, hidden, self.tile_tokens),
            attention_mask=mask,
            position_ids=positions,
            position_embeddings=rotary,
        )
        return hidden + out[0], attention_mask, position_ids, labels, sums


class MlpStage(nn.Module):
    """The second half of a decoder block: ``h + mlp(post_attention_layernorm(h))``, router sums included.

    ``tile_tokens``: run the norm and the MLP over at most this many tokens at a time
    (:func:`~lightning_roundpipe.models.tiling.tiled`), so the stage keeps only its input for backward
    (4 instead of 64 KiB per token on a Qwen3-1.7B-shaped model, bf16) and one tile's intermediates are
    alive at a time."""

    def __init__(self, layer: nn.Module, config: Any, tile_tokens: int | None = None) -> None:
        super().__init__()
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.mlp = layer.mlp
        self.config = config
        self.tile_tokens = tile_tokens

    def _norm_mlp(self, hidden: Tensor) -> Tensor:
        out = self.mlp(self.post_attention_layernorm(hidden))
        return out[0] if isinstance(out, tuple) else out

    def forward(self, state: State) -> State:
        hidden, attention_mask, position_ids, labels, sums = state
        router = _router_of(self.mlp) if sums is not None else None
        if router is not None and self.tile_tokens is not None:
            raise ValueError(
                "tile_tokens cannot tile a mixture-of-experts MLP while its router logits are collected"
                " (output_router_logits=True): the load-balancing loss needs them whole"
            )
        with _RouterLogits(router) as logits:
            out = tiled(self, self._norm_mlp, hidden, self.tile_tokens)
        if logits:
            assert sums is not None
            sums = _add_router_sums(sums, logits[0], attention_mask, self.config.num_experts_per_tok)
        return hidden + out, attention_mask, position_ids, labels, sums


class OutputStage(nn.Module):
    """Final norm, LM head and the loss Hugging Face computes: next-token cross-entropy, labels shifted
    by one, ``-100`` ignored, mean over the counted tokens, in chunks (never full-vocabulary logits);
    plus ``router_aux_loss_coef`` times the load-balancing loss when router sums travelled."""

    def __init__(self, norm: nn.Module, lm_head: nn.Linear, chunk_size: int = 2048, aux_coef: float = 0.0) -> None:
        super().__init__()
        if getattr(lm_head, "bias", None) is not None:
            raise ValueError("the chunked LM-head loss supports heads without bias only")
        self.norm = norm
        self.lm_head = lm_head
        self.chunk_size = chunk_size
        self.aux_coef = aux_coef
        self.fused_loss = False
        """Liger's fused linear cross-entropy on CUDA tensors (:mod:`.kernels`), instead of the chunked loss."""

    def forward(self, state: State) -> Tensor:
        hidden, _, _, labels, sums = state
        if labels is None:
            raise ValueError("training through roundpipe needs `labels` in the batch (the loss is computed there)")
        hidden = self.norm(hidden)
        if self.fused_loss and hidden.is_cuda:
            loss = fused_linear_cross_entropy(hidden, self.lm_head.weight, shift_labels(labels), IGNORE_INDEX)
        else:
            loss = chunked_linear_cross_entropy(
                hidden, self.lm_head.weight, shift_labels(labels), IGNORE_INDEX, self.chunk_size
            )
        if sums is not None:
            per_expert, probs_sum, rows = sums
            aux = (per_expert / rows * (probs_sum / rows)).sum() * per_expert.numel()
            loss = loss + self.aux_coef * aux
        return loss
