"""Hugging Face causal LMs as layer sequences, so ``self.model(**batch).loss`` trains unchanged.

A preset turns a supported ``*ForCausalLM`` into: an input stage (token embedding), one stage per
decoder block, and an output stage (final norm, LM head, chunked loss). What crosses a stage
boundary is ``(hidden_states, attention_mask, position_ids, labels)``: the 2-D padding mask, never
an O(seq^2) one; each block builds the attention mask its implementation needs with transformers'
public ``create_causal_mask`` (called positionally, since its cache argument was renamed between
releases) and its rotary tables from the position ids. Parameters stay the model's own, so tied
input/output embeddings remain one parameter with one gradient.

Only ``transformers`` is imported here, and only when a Hugging Face model is pipelined: the core
package does not need it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_roundpipe.models.chunked_loss import chunked_linear_cross_entropy

IGNORE_INDEX = -100

State = tuple[Tensor, Tensor | None, Tensor, Tensor | None]
"""What travels between stages: hidden states, 2-D padding mask, position ids, labels."""


class InputStage(nn.Module):
    """Token embedding; the rest of the batch passes through."""

    def __init__(self, embed_tokens: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, batch: State) -> State:
        input_ids, attention_mask, position_ids, labels = batch
        return self.embed_tokens(input_ids), attention_mask, position_ids, labels


class DecoderStage(nn.Module):
    """One decoder block with its attention mask and rotary tables made here, per micro-batch."""

    def __init__(self, layer: nn.Module, rotary_emb: nn.Module, config: Any, index: int) -> None:
        super().__init__()
        self.layer = layer
        self.rotary_emb = rotary_emb
        self.config = config
        types = getattr(config, "layer_types", None)
        self.sliding = bool(types) and types[index] == "sliding_attention"

    def forward(self, state: State) -> State:
        hidden, attention_mask, position_ids, labels = state
        from transformers import masking_utils

        make_mask = (
            masking_utils.create_sliding_window_causal_mask if self.sliding else masking_utils.create_causal_mask
        )
        # (config, inputs_embeds, attention_mask, cache): the cache argument is positional on purpose
        mask = make_mask(self.config, hidden, attention_mask, None, position_ids=position_ids)
        out = self.layer(
            hidden,
            attention_mask=mask,
            position_ids=position_ids,
            position_embeddings=self.rotary_emb(hidden, position_ids),
        )
        return (out[0] if isinstance(out, tuple) else out), attention_mask, position_ids, labels


class OutputStage(nn.Module):
    """Final norm, LM head and the loss Hugging Face computes: next-token cross-entropy, labels shifted
    by one, ``-100`` ignored, mean over the counted tokens; in chunks, never full-vocabulary logits."""

    def __init__(self, norm: nn.Module, lm_head: nn.Linear, chunk_size: int = 2048) -> None:
        super().__init__()
        if getattr(lm_head, "bias", None) is not None:
            raise ValueError("the chunked LM-head loss supports heads without bias only")
        self.norm = norm
        self.lm_head = lm_head
        self.chunk_size = chunk_size

    def forward(self, state: State) -> Tensor:
        hidden, _, _, labels = state
        if labels is None:
            raise ValueError("training through roundpipe needs `labels` in the batch (the loss is computed there)")
        return chunked_linear_cross_entropy(
            self.norm(hidden), self.lm_head.weight, shift_labels(labels), IGNORE_INDEX, self.chunk_size
        )


def shift_labels(labels: Tensor) -> Tensor:
    """Token t is predicted from positions < t: labels move one step left, the last position ignored."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def counted_tokens(labels: Tensor) -> Tensor:
    """The micro-batch's share of the batch loss: its tokens that have a (shifted) label."""
    return (shift_labels(labels) != IGNORE_INDEX).sum()


def _dense_decoder(model: nn.Module) -> list[nn.Module]:
    inner = model.model
    config = model.config
    layers = list(inner.layers[: config.num_hidden_layers])
    stages: list[nn.Module] = [InputStage(inner.embed_tokens)]
    stages += [DecoderStage(layer, inner.rotary_emb, config, i) for i, layer in enumerate(layers)]
    stages.append(OutputStage(inner.norm, model.lm_head))
    return stages


PRESETS: dict[str, Callable[[nn.Module], list[nn.Module]]] = {
    "LlamaForCausalLM": _dense_decoder,
    "Qwen3ForCausalLM": _dense_decoder,
}
"""Architecture (class name) to the function building its layer sequence."""


def unwrap(module: nn.Module) -> nn.Module:
    """The Hugging Face model inside a ``peft`` wrapper (``PeftModel.base_model.model``), else itself."""
    base = getattr(module, "base_model", None)
    inner = getattr(base, "model", None)
    if base is not None and inner is not None and type(module).__module__.startswith("peft"):
        return inner
    return module


def is_hf_model(module: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(unwrap(module), PreTrainedModel)


def build_layers(model: nn.Module) -> list[nn.Module]:
    """The layer sequence for a supported Hugging Face causal LM; a clear error otherwise."""
    hf = unwrap(model)
    name = type(hf).__name__
    if name not in PRESETS:
        raise ValueError(
            f"roundpipe has no preset for {name}; supported: {sorted(PRESETS)}. Add one to"
            " `lightning_roundpipe.models.hf.PRESETS` (a function returning the model's layers as modules), or"
            " keep the model as an `nn.Sequential` and train it with `lightning_roundpipe.pipeline_loss`."
        )
    return PRESETS[name](hf)


class Interceptor:
    """Routes the Hugging Face model's ``forward`` through the pipeline during training steps.

    ``run(inputs, target)`` is the engine call; outside training steps (validation, generation)
    the model's own forward runs on the host weights.
    """

    def __init__(self, model: nn.Module, run: Callable[[Any, Any], Tensor], active: Callable[[], bool]) -> None:
        self.model = unwrap(model)
        self._run = run
        self._active = active
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
        if not self._active():
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
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        loss = self._run((input_ids, attention_mask, position_ids, labels), labels)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return CausalLMOutputWithPast(loss=loss)

    def restore(self) -> None:
        if self.model.__dict__.get("forward") is self:
            del self.model.forward
