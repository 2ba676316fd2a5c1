"""Attention masks and rotary tables, made once per micro-batch and stage and shared by its blocks, and the
host-side check that lets masks be skipped."""

from __future__ import annotations

import copy as _copy
import functools
import inspect
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_roundpipe.models.hf.packed import is_packed
from lightning_roundpipe.models.hf.state import State

AttentionInputs = tuple[Any, Tensor, tuple[Tensor, Tensor]]

_RECENT = threading.local()
"""Per thread (one worker, one device): the attention inputs of the micro-batch passing through, by sliding
and layer type."""


def _attention_inputs(
    config: Any, sliding: bool, rotary_emb: nn.Module, state: State, layer_type: str | None = None
) -> AttentionInputs:
    """The attention mask the implementation needs, the positions and the rotary tables (of ``layer_type``
    where the rotary module keeps one per type) for a micro-batch, from the 2-D padding mask and the
    position ids that travel. Made by the first block of a stage a micro-batch meets and shared by the
    blocks after it: made in every block they took a sixth of the host's time in a block's forward, and
    at small micro-batches the host's launches are what the device waits for (docs/perf-notes.md). The
    micro-batch's pass is told by its labels, the same tensor through a stage's blocks and a new one at
    every upload: the inputs are let go with it (no mask outlives the pass, and a rotary module changed
    between batches is read again). Without labels, made per block."""
    hidden, attention_mask, position_ids, labels, _ = state
    if labels is None:
        return _make_attention_inputs(config, sliding, rotary_emb, hidden, attention_mask, position_ids, layer_type)
    made: dict[tuple[bool, str | None], tuple[Any, ...]] | None = getattr(_RECENT, "made", None)
    if made is None:
        made = _RECENT.made = {}
    key = (sliding, layer_type)
    shape = (*hidden.shape[:2], hidden.dtype, hidden.device, torch.is_inference_mode_enabled())
    last = made.get(key)
    # tensors compared by identity: the stage's blocks pass the same ones along
    same = last is not None and last[0]() is labels and last[1] is attention_mask and last[2] is position_ids
    if same and last[3] == shape:
        return last[4]
    inputs = _make_attention_inputs(config, sliding, rotary_emb, hidden, attention_mask, position_ids, layer_type)
    entry = made[key] = (weakref.ref(labels), attention_mask, position_ids, shape, inputs)
    weakref.finalize(labels, _let_go, made, key, entry)
    return inputs


def _let_go(made: dict[Any, Any], key: Any, entry: tuple[Any, ...]) -> None:
    """A micro-batch's labels are gone: so are its attention inputs, unless another pass replaced them.
    (Run by whichever thread drops the labels: a race with the worker costs at most one remade entry.)"""
    if made.get(key) is entry:
        made.pop(key, None)


def _make_attention_inputs(
    config: Any, sliding: bool, rotary_emb: nn.Module, hidden: Tensor, attention_mask: Tensor | None,
    position_ids: Tensor | None, layer_type: str | None,
) -> AttentionInputs:  # fmt: skip
    # packed: each sequence attends to itself in the attention function (`packed`), no mask
    mask = None if is_packed(attention_mask) else _mask(config, sliding, hidden, attention_mask, position_ids)
    positions = position_ids
    if positions is None:
        positions = torch.arange(hidden.shape[1], device=hidden.device).expand(hidden.shape[0], -1)
    rotary = rotary_emb(hidden, positions) if layer_type is None else rotary_emb(hidden, positions, layer_type)
    return mask, positions, rotary


def _mask(
    config: Any, sliding: bool, hidden: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None
) -> Any:
    """The attention mask transformers' mask functions make for the configured implementation (SDPA's for
    eager attention, turned additive here)."""
    from transformers import masking_utils

    make_mask = masking_utils.create_sliding_window_causal_mask if sliding else masking_utils.create_causal_mask
    # A padding mask next to plain positions has padding in it (`plain_inputs` drops all-ones masks), so
    # the SDPA shortcut to `is_causal` cannot apply; transformers would still test the mask for it on
    # the device in every block, a host sync each time. Where it takes the flag, it is told not to.
    skip = {"allow_is_causal_skip": False} if attention_mask is not None and position_ids is None else {}
    # Eager attention's mask is the SDPA one turned additive, but transformers makes the 0 of `where` a
    # device tensor from the host: a sync per block. The boolean mask is asked for, and turned here.
    sdpa_config = _as_sdpa(config) if getattr(config, "_attn_implementation", None) == "eager" else None
    if sdpa_config is not None:
        config, skip = sdpa_config, {"allow_is_causal_skip": False}
    if skip and not _takes_causal_skip_flag(make_mask):
        skip = {}
    # (config, inputs_embeds, attention_mask, cache): the cache argument is positional on purpose.
    # Positions travel only when they are not 0..T-1 (packed sequences); see `plain_inputs`.
    mask = make_mask(config, hidden, attention_mask, None, position_ids=position_ids, **skip)
    if sdpa_config is not None and isinstance(mask, Tensor) and mask.dtype == torch.bool:
        additive = torch.zeros(mask.shape, dtype=hidden.dtype, device=mask.device)
        mask = additive.masked_fill_(mask.logical_not(), torch.finfo(hidden.dtype).min)
    return mask


_SDPA_TWINS: dict[int, tuple[Any, Any]] = {}


def _as_sdpa(config: Any) -> Any | None:
    """A shallow copy of ``config`` that asks transformers' mask functions for SDPA's boolean mask (the
    internal field set directly: the public setter would also rewrite sub-configs the copy shares), or
    ``None`` where this release keeps the implementation elsewhere."""
    twin = _SDPA_TWINS.get(id(config))
    if twin is None or twin[0] is not config:
        copy = _copy.copy(config)
        copy.__dict__["_attn_implementation_internal"] = "sdpa"
        twin = _SDPA_TWINS[id(config)] = (config, copy if copy._attn_implementation == "sdpa" else None)
    return twin[1]


@functools.cache
def _takes_causal_skip_flag(make_mask: Callable[..., Any]) -> bool:
    """Whether this transformers release's mask function has ``allow_is_causal_skip``."""
    return "allow_is_causal_skip" in inspect.signature(make_mask).parameters


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
