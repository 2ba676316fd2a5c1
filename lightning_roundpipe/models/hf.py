"""Hugging Face causal LMs as layer sequences, so ``self.model(**batch).loss`` trains unchanged.

A preset turns a supported ``*ForCausalLM`` into: an input stage (token embedding), one stage per
decoder block, and an output stage (final norm, LM head, chunked loss). What crosses a stage boundary
is ``(hidden_states, attention_mask, position_ids, labels, router_sums)``: the 2-D padding mask, never
an O(seq^2) one, and, for mixture-of-experts models with ``output_router_logits``, the running
per-expert sums the load-balancing loss is made of. Each block builds the attention mask its
implementation needs with transformers' public ``create_causal_mask`` (called positionally: its cache
argument was renamed between releases) and its rotary tables from the position ids. Parameters stay
the model's own, so tied input/output embeddings remain one parameter with one gradient.

Only ``transformers`` is imported here, and only when a Hugging Face model is pipelined: the core
package does not need it.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_roundpipe.models.chunked_loss import chunked_linear_cross_entropy
from lightning_roundpipe.models.tiling import tiled

IGNORE_INDEX = -100

State = tuple[Tensor, Tensor | None, Tensor | None, Tensor | None, tuple[Tensor, Tensor, Tensor] | None]
"""What travels between stages: hidden states, 2-D padding mask, position ids, labels, and the router
sums (tokens per expert, router probability per expert, counted rows) of the layers so far."""


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


def _sliding(config: Any, index: int) -> bool:
    types = getattr(config, "layer_types", None)
    return bool(types) and types[index] == "sliding_attention"


def _attention_inputs(
    config: Any, sliding: bool, rotary_emb: nn.Module, state: State
) -> tuple[Any, Tensor, tuple[Tensor, Tensor]]:
    """The attention mask the implementation needs, the positions and the rotary tables, made per
    micro-batch from the 2-D padding mask and the position ids that travel."""
    hidden, attention_mask, position_ids, _, _ = state
    from transformers import masking_utils

    make_mask = masking_utils.create_sliding_window_causal_mask if sliding else masking_utils.create_causal_mask
    # A padding mask next to plain positions has padding in it (`plain_inputs` drops all-ones masks), so
    # the SDPA shortcut to `is_causal` cannot apply; transformers would still test the mask for it on
    # the device in every block, a host sync each time. Where it takes the flag, it is told not to.
    skip = {"allow_is_causal_skip": False} if attention_mask is not None and position_ids is None else {}
    if skip and not _takes_causal_skip_flag(make_mask):
        skip = {}
    # (config, inputs_embeds, attention_mask, cache): the cache argument is positional on purpose.
    # Positions travel only when they are not 0..T-1 (packed sequences); see `plain_inputs`.
    mask = make_mask(config, hidden, attention_mask, None, position_ids=position_ids, **skip)
    positions = position_ids
    if positions is None:
        positions = torch.arange(hidden.shape[1], device=hidden.device).expand(hidden.shape[0], -1)
    return mask, positions, rotary_emb(hidden, positions)


@functools.cache
def _takes_causal_skip_flag(make_mask: Callable[..., Any]) -> bool:
    """Whether this transformers release's mask function has ``allow_is_causal_skip``."""
    return "allow_is_causal_skip" in inspect.signature(make_mask).parameters


class _RouterLogits(list):
    """Collects the router's logits while the block runs (nothing when there is no router)."""

    def __init__(self, router: nn.Module | None) -> None:
        super().__init__()
        self.router = router
        self.handle: Any = None

    def __enter__(self) -> _RouterLogits:
        if self.router is not None:
            self.handle = self.router.register_forward_hook(
                lambda _m, _i, out: self.append(out[0] if isinstance(out, tuple) else out)
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self.handle is not None:
            self.handle.remove()


def _router_of(mlp: nn.Module | None) -> nn.Module | None:
    """The module whose output is the block's router logits (``mlp.gate`` of a sparse block), if any."""
    return getattr(mlp, "gate", None) if mlp is not None and hasattr(mlp, "experts") else None


def _add_router_sums(
    sums: tuple[Tensor, Tensor, Tensor], logits: Tensor, attention_mask: Tensor | None, top_k: int
) -> tuple[Tensor, Tensor, Tensor]:
    """One layer's share of the load-balancing loss, as transformers' ``load_balancing_loss_func`` sums it."""
    per_expert, probs_sum, rows = sums
    probs = torch.softmax(logits.float(), dim=-1)
    selected = torch.topk(probs, top_k, dim=-1).indices.reshape(-1)
    if attention_mask is None:
        weight = torch.ones(probs.shape[0], dtype=torch.float32, device=probs.device)
    else:
        weight = attention_mask.reshape(-1).to(torch.float32)
    counts = torch.zeros_like(per_expert).scatter_add_(0, selected, weight.repeat_interleave(top_k))
    return per_expert + counts, probs_sum + (probs * weight[:, None]).sum(0), rows + weight.sum()


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

    def forward(self, state: State) -> Tensor:
        hidden, _, _, labels, sums = state
        if labels is None:
            raise ValueError("training through roundpipe needs `labels` in the batch (the loss is computed there)")
        loss = chunked_linear_cross_entropy(
            self.norm(hidden), self.lm_head.weight, shift_labels(labels), IGNORE_INDEX, self.chunk_size
        )
        if sums is not None:
            per_expert, probs_sum, rows = sums
            aux = (per_expert / rows * (probs_sum / rows)).sum() * per_expert.numel()
            loss = loss + self.aux_coef * aux
        return loss


def shift_labels(labels: Tensor) -> Tensor:
    """Token t is predicted from positions < t: labels move one step left, the last position ignored."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def counted_tokens(labels: Tensor) -> Tensor:
    """The micro-batch's share of the batch loss: its tokens that have a (shifted) label."""
    return (shift_labels(labels) != IGNORE_INDEX).sum()


def _decoder(model: nn.Module, split: bool = False, tile_tokens: int | None = None) -> list[nn.Module]:
    """Embedding, the decoder blocks (each as two layers when ``split``, their token-wise parts tiled
    over ``tile_tokens`` tokens), final norm and head: Llama, Qwen3 and Qwen3-MoE share this shape."""
    inner = model.model
    config = model.config
    layers = list(inner.layers[: config.num_hidden_layers])
    experts = int(getattr(config, "num_experts", 0) or 0) if getattr(config, "output_router_logits", False) else 0
    stages: list[nn.Module] = [InputStage(inner.embed_tokens, experts)]
    for i, layer in enumerate(layers):
        if split:
            stages += [
                AttentionStage(layer, inner.rotary_emb, config, i, tile_tokens),
                MlpStage(layer, config, tile_tokens),
            ]
        else:
            stages.append(DecoderStage(layer, inner.rotary_emb, config, i))
    aux_coef = float(getattr(config, "router_aux_loss_coef", 0.0)) if experts else 0.0
    stages.append(OutputStage(inner.norm, model.lm_head, aux_coef=aux_coef))
    return stages


PRESETS: dict[str, Callable[..., list[nn.Module]]] = {
    "LlamaForCausalLM": _decoder,
    "Qwen3ForCausalLM": _decoder,
    "Qwen3MoeForCausalLM": _decoder,
}
"""Architecture (class name) to the function building its layer sequence: ``preset(model)``; a preset
that can split each decoder block into an attention layer and an MLP layer also takes ``split=True``."""


def unwrap(module: nn.Module) -> nn.Module:
    """The Hugging Face model inside a ``peft`` wrapper (``PeftModel.base_model.model``), else itself."""
    base = getattr(module, "base_model", None)
    inner = getattr(base, "model", None)
    if base is not None and inner is not None and type(module).__module__.startswith("peft"):
        return inner
    return module


def is_hf_model(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers ``PreTrainedModel`` or a peft wrapper of one."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(unwrap(module), PreTrainedModel)


def build_layers(
    model: nn.Module, split_decoder_layers: bool = False, tile_tokens: int | None = None
) -> list[nn.Module]:
    """The layer sequence for a supported Hugging Face causal LM; a clear error otherwise.

    ``split_decoder_layers``: each decoder block becomes two layers, attention and MLP, with the same
    arithmetic. A stage can then end inside a block: one stage's activations are about half a block's
    (what bounds the longest sequence), and stages balance at a finer grain. ``tile_tokens`` (with
    the split): the token-wise parts of each layer (the MLP with its norm, the attention's input norm)
    run over at most that many tokens at a time and keep only their inputs
    (:mod:`~lightning_roundpipe.models.tiling`)."""
    if tile_tokens is not None:
        if not split_decoder_layers:
            raise ValueError(
                f"tile_tokens={tile_tokens} tiles the attention and MLP layers that split_decoder_layers=True"
                " makes; pass both"
            )
        if tile_tokens < 1:
            raise ValueError(f"tile_tokens={tile_tokens} must be at least 1")
    hf = unwrap(model)
    name = type(hf).__name__
    if name not in PRESETS:
        raise ValueError(
            f"roundpipe has no preset for {name}; supported: {sorted(PRESETS)}. Add one to"
            " `lightning_roundpipe.models.hf.PRESETS` (a function of the model returning its layers as modules), or"
            " keep the model as an `nn.Sequential` and train it with `lightning_roundpipe.pipeline_loss`."
        )
    preset = PRESETS[name]
    if not split_decoder_layers:
        return preset(hf)
    if "split" not in inspect.signature(preset).parameters:
        raise ValueError(
            f"the {name} preset cannot split decoder layers (its function takes no `split` argument); use"
            " RoundPipeStrategy(split_decoder_layers=False) or give the preset a `split` keyword"
        )
    if tile_tokens is None:
        return preset(hf, split=True)
    if "tile_tokens" not in inspect.signature(preset).parameters:
        raise ValueError(f"the {name} preset cannot tile its layers (its function takes no `tile_tokens`)")
    return preset(hf, split=True, tile_tokens=tile_tokens)


def plain_inputs(attention_mask: Tensor | None, position_ids: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """``None`` for a padding mask of all ones and for positions ``0..T-1`` in every row: what they mean
    is then the causal mask alone. Decided once per batch, on the host; passed on, transformers' mask
    functions check them on the GPU in every layer, and each check waits for the GPU (a host sync)."""
    if position_ids is not None:
        arange = torch.arange(position_ids.shape[-1], device=position_ids.device)
        if bool((position_ids == arange).all()):
            position_ids = None
    # an all-ones mask says nothing only next to plain positions: with the mask gone, transformers would
    # read packed positions as separate documents, which it does not do while a mask is passed
    if position_ids is None and attention_mask is not None and attention_mask.dim() == 2 and attention_mask.all():
        attention_mask = None
    return attention_mask, position_ids


class Interceptor:
    """Routes the Hugging Face model's ``forward`` through the pipeline during training steps.

    ``run(inputs, target)`` is the engine call; outside training steps (validation, generation)
    the model's own forward runs on the host weights.
    """

    def __init__(
        self,
        model: nn.Module,
        run: Callable[[Any, Any], Tensor],
        active: Callable[[], bool],
        evaluating: Callable[[], bool] = lambda: False,
    ) -> None:
        self.model = unwrap(model)
        self._run = run
        self._active = active
        self._evaluating = evaluating
        self._warned_cache = False
        self._original = self.model.forward
        self.model.forward = self  # an instance attribute: nn.Module.__call__ finds it first

    def __call__(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        labels: Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        # validation/test steps with labels: the loss through the pipeline (forward only); anything else
        # outside a training step (generation, logits for metrics) runs the model itself on the host
        if not self._active() and not (self._evaluating() and labels is not None):
            return self._original(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, labels=labels, **kwargs
            )
        if kwargs.pop("use_cache", False) and not self._warned_cache:
            self._warned_cache = True
            warnings.warn("roundpipe trains without a KV cache; `use_cache=True` is ignored", stacklevel=2)
        for key in ("past_key_values", "cache"):
            if kwargs.pop(key, None) is not None:
                raise ValueError(f"`{key}` cannot be used while training through roundpipe")
        kwargs = {k: v for k, v in kwargs.items() if v is not None and v is not False and k != "return_dict"}
        if kwargs:
            raise ValueError(
                f"roundpipe's {type(self.model).__name__} preset takes input_ids, attention_mask, position_ids and"
                f" labels; got also {sorted(kwargs)}"
            )
        if input_ids is None:
            raise ValueError("roundpipe needs `input_ids` (inputs_embeds are not supported)")
        if labels is None:
            raise ValueError("roundpipe computes the loss inside the pipeline: pass `labels`")
        attention_mask, position_ids = plain_inputs(attention_mask, position_ids)
        loss = self._run((input_ids, attention_mask, position_ids, labels), labels)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return CausalLMOutputWithPast(loss=loss)

    def restore(self) -> None:
        if self.model.__dict__.get("forward") is self:
            del self.model.forward
