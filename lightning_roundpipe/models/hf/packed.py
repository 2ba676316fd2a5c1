"""Packed micro-batches: a micro-batch's sequences laid end to end in one row, with no padding, and attention
that keeps each sequence to itself (``RoundPipeStrategy(split_by="packed")``, and a flattened batch's
micro-batches with every default: :class:`~lightning_roundpipe.models.hf.tokens.TokenSplit`).

Cut by tokens (:mod:`.tokens`), a micro-batch still pads its rows to its longest one, and every new (rows,
length) shape is one more shape for the attention kernels (cuDNN's builds a graph per shape) and for compiled
blocks (a single row compiles apart from several). Packed, a micro-batch holds real tokens only, in one row:
position ids restart at 0 at each sequence (as transformers' ``DataCollatorWithFlattening`` makes them), and the
first label of each sequence is -100 (the sequence before it does not predict it; in a padded row nothing
predicted it either: the loss has the same terms and the same count). Its sequences' boundaries travel between
stages in the padding mask's place, as cumulative lengths (1-D int32; a padding mask is 2-D). Attention runs over
each sequence alone: on CUDA in half precision through torch's variable-length flash attention
(``torch.nn.attention.varlen``), elsewhere (and for a flattened batch where that kernel cannot run) through SDPA
with a mask that keeps each sequence to itself.

The workers' replicas point their attention at :data:`NAME`, registered with transformers next to its own
implementations: SDPA for micro-batches that are not packed. The user's model keeps its own setting.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_roundpipe.models.hf.labels import IGNORE_INDEX

NAME = "roundpipe_packed"
"""The attention implementation a replica runs packed micro-batches with (SDPA for any other)."""


def is_packed(attention_mask: Tensor | None) -> bool:
    """Whether a stage's padding-mask slot holds a packed micro-batch's cumulative sequence lengths."""
    return attention_mask is not None and attention_mask.dim() == 1


Piece = tuple[int, int, int]
"""One sequence of a batch: ``(row, first column, length)``."""


def pack(
    input_ids: Tensor, labels: Tensor, pieces: Sequence[Piece], positions: Tensor | None = None
) -> tuple[Tensor, ...]:
    """Sequences ``pieces`` of a batch in one row: the inputs ``(ids, cumulative lengths, positions, labels)`` of
    a packed micro-batch. Positions are the batch's own where it has them (a flattened batch's), else each
    sequence's ``0..n-1``."""
    ids = torch.cat([input_ids[r, a : a + n] for r, a, n in pieces])[None]
    if positions is None:
        position_ids = torch.cat([torch.arange(n, device=input_ids.device) for _, _, n in pieces])[None]
    else:
        position_ids = torch.cat([positions[r, a : a + n] for r, a, n in pieces])[None]
    parts = []
    for r, a, n in pieces:
        part = labels[r, a : a + n].clone()
        part[0] = IGNORE_INDEX  # the previous sequence's last token does not predict this one
        parts.append(part)
    bounds = torch.tensor([0, *itertools.accumulate(n for _, _, n in pieces)], dtype=torch.int32)
    return ids, bounds.to(input_ids.device), position_ids, torch.cat(parts)[None]


def sequences(position_ids: Tensor) -> list[Piece]:
    """The sequences of a flattened batch (transformers' ``DataCollatorWithFlattening``): one starts where a
    position does not follow the one before it by one, as transformers' own mask functions read them."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    width = position_ids.shape[1]
    pieces = []
    for row in range(starts.shape[0]):
        first = starts[row].nonzero().flatten().tolist()
        pieces += [(row, a, b - a) for a, b in zip(first, [*first[1:], width])]
    return pieces


def attention_kwargs(module: nn.Module, attention_mask: Tensor | None, tokens: int) -> dict[str, Any]:
    """What a decoder block is called with besides its usual arguments: for a packed micro-batch, transformers'
    variable-length keywords (its flash attention's names) and whether torch's flash kernel runs it
    (``roundpipe_flash``: decided here, eagerly, not inside a compiled block), with ``module``'s replica pointed
    at :data:`NAME`; nothing otherwise. ``tokens``: the row's length, the bound given for the longest sequence
    (no host sync)."""
    if not is_packed(attention_mask):
        return {}
    use_packed_attention(module)
    flash = False
    if attention_mask.is_cuda:  # once per replica, device and autocast setting: not per block call
        key = (attention_mask.device, torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda"))
        checked = module.__dict__.get("_roundpipe_flash")
        if checked is None or checked[0] != key:
            checked = module.__dict__["_roundpipe_flash"] = (key, _choose_flash(module, attention_mask.device))
        flash = checked[1]
    return {
        "cu_seq_lens_q": attention_mask, "cu_seq_lens_k": attention_mask, "max_length_q": tokens,
        "max_length_k": tokens, "roundpipe_flash": flash,
    }  # fmt: skip


REQUIRED = "_roundpipe_flash_required"
"""Set on a stage (``RoundPipeStrategy(split_by="packed")``): a packed micro-batch on CUDA runs torch's flash kernel
or fails with why; otherwise (a flattened batch under ``"auto"``) it falls back to SDPA sequence by sequence."""


def require_flash(layers: Sequence[nn.Module]) -> None:
    """``split_by="packed"`` asked for the flash kernel: where it cannot run, the first packed micro-batch says why."""
    for layer in layers:
        layer.__dict__[REQUIRED] = True


def _choose_flash(module: nn.Module, device: torch.device) -> bool:
    why = why_not_flash(module, device)
    if why is None:
        return True
    if module.__dict__.get(REQUIRED):
        raise ValueError(
            f"RoundPipeStrategy(split_by='packed') runs attention on CUDA through torch's variable-length flash"
            f" kernel, which cannot run here: {why}. Use split_by='auto'."
        )
    _warn_once(
        f"roundpipe: packed micro-batches run attention through SDPA with a mask per micro-batch (memory growing"
        f" with the square of its tokens): torch's variable-length flash kernel cannot run on {device} ({why})"
    )
    return False


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, stacklevel=2)


def use_packed_attention(module: nn.Module) -> None:
    """Point a replica's model config (its own deep copy, shared by its attention modules) at :data:`NAME`."""
    config = module.config
    if config._attn_implementation == NAME:
        return
    if "_roundpipe_replica" not in module.__dict__:
        raise RuntimeError("packed micro-batches run on the workers' replicas only, not on the user's modules")
    _check_implementation(config._attn_implementation)
    register()
    config.__dict__["_attn_implementation_internal"] = NAME  # the field itself: the setter rewrites sub-configs


def why_not_flash(module: nn.Module, device: torch.device, half: bool | None = None) -> str | None:
    """Why torch's flash kernel cannot run a packed micro-batch on this CUDA device (``None``: it can): no
    ``torch.nn.attention.varlen``, a card before sm80, a head size it does not take, attention not in half
    precision (``half``: whether it runs in half precision; ``None``: as autocast and the weights say now), or a
    scale this torch's kernel does not take."""
    config = module.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if half is None:
        weight = next((p for p in module.parameters() if p.is_floating_point()), None)
        half = (torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") in _HALF) or (
            weight is not None and weight.dtype in _HALF
        )
    scaling = next((m.scaling for m in module.modules() if isinstance(getattr(m, "scaling", None), float)), None)
    unscaled = "scale" not in _VARLEN_TAKES and scaling is not None and abs(scaling - head_dim**-0.5) > 1e-9
    return (
        "this torch has no torch.nn.attention.varlen" if _VARLEN is None
        else f"this torch's varlen_attn takes no scale, and the model's is {scaling:g}" if unscaled
        else f"{device} is older than sm80" if _capability(device) < (8, 0)
        else f"its head size {head_dim} is not a multiple of 8 up to 256" if head_dim % 8 or head_dim > 256
        else "attention would run in float32 (precision='bf16-mixed', '16-mixed' or a half-precision model runs it"
        " in half precision)" if not half else None
    )  # fmt: skip


_HALF = (torch.float16, torch.bfloat16)


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@functools.cache
def register() -> None:
    """Add :data:`NAME` to transformers' attention and mask implementations (its masks are SDPA's)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
    dropout: float = 0.0, scaling: float | None = None, **kwargs: Any,
) -> tuple[Tensor, None]:  # fmt: skip
    """Transformers' attention interface: ``(batch, heads, tokens, dim)`` in, ``(batch, tokens, heads, dim)``
    out. Packed (``cu_seq_lens_q`` given): causal attention within each sequence; else SDPA as transformers runs it."""
    bounds = kwargs.get("cu_seq_lens_q")
    if bounds is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    for name in ("sliding_window", "softcap", "s_aux", "position_bias"):
        if kwargs.get(name) is not None:
            raise ValueError(f"packed micro-batches do not take attention with {name}: use split_by='auto'")
    if dropout:
        raise ValueError("packed micro-batches run attention without dropout: use split_by='auto'")
    if query.shape[0] != 1:
        raise ValueError(f"a packed micro-batch is one row, not {query.shape[0]}")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if kwargs.get("roundpipe_flash"):  # `attention_kwargs` checked that the flash kernel runs here
        out = _flash(_VARLEN, query[0], key[0], value[0], bounds, kwargs["max_length_q"], scale)  # a SymInt compiled
    else:
        out = _by_sequence(query[0], key[0], value[0], bounds, scale)
    return out[None], None


def _by_sequence(query: Tensor, key: Tensor, value: Tensor, bounds: Tensor, scale: float) -> Tensor:
    """``(heads, tokens, dim)`` in, ``(tokens, heads, dim)`` out: SDPA with a causal mask within each sequence
    (made on the device from the boundaries: no host sync, one graph whatever the sequences). Four-dimensional,
    with keys and values repeated for grouped queries, as transformers calls it: SDPA's CUDA kernels that take a
    mask refuse 3-D inputs and a mask with ``enable_gqa``, and its math kernel holds every score in float32."""
    tokens = torch.arange(query.shape[1], device=query.device)
    sequence = torch.searchsorted(bounds[1:].to(tokens.dtype), tokens, right=True)
    mask = (sequence[:, None] == sequence[None, :]) & (tokens[:, None] >= tokens[None, :])
    if key.shape[0] != query.shape[0]:
        key, value = (t.repeat_interleave(query.shape[0] // key.shape[0], dim=0) for t in (key, value))
    out = F.scaled_dot_product_attention(query[None], key[None], value[None], mask[None, None], scale=scale)
    return out[0].transpose(0, 1)


def _find_varlen() -> tuple[Any, frozenset[str]]:
    """torch's variable-length attention (``torch.nn.attention.varlen.varlen_attn``) and its keywords, or
    ``None`` before it. Looked up once at import: the attention runs inside compiled blocks, where a lookup
    or a signature read would break the graph."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, frozenset()
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


_VARLEN, _VARLEN_TAKES = _find_varlen()


def _flash(
    varlen: Any, query: Tensor, key: Tensor, value: Tensor, bounds: Tensor, longest: int, scale: float
) -> Tensor:
    """``(heads, tokens, dim)`` in, ``(tokens, heads, dim)`` out, through ``varlen_attn`` (its keywords differ
    between torch releases: causality as ``is_causal`` or as a window, GQA by a flag or without one)."""
    takes = _VARLEN_TAKES
    q, k, v = (t.transpose(0, 1) for t in (query, key, value))
    options: dict[str, Any] = {}
    if "window_size" in takes:
        options["window_size"] = (-1, 0)
    else:
        options["is_causal"] = True
    if "scale" in takes:
        options["scale"] = scale
    elif abs(scale - query.shape[-1] ** -0.5) > 1e-12:
        raise ValueError("this torch's varlen_attn takes no scale, and the model's attention is not 1/sqrt(dim)")
    if k.shape[1] != q.shape[1] and "enable_gqa" in takes:  # before the flag, the flash kernel took GQA as is
        options["enable_gqa"] = True
    bounds = bounds.to(torch.int32)
    return varlen(q.contiguous(), k.contiguous(), v.contiguous(), bounds, bounds, longest, longest, **options)


def packable(model: nn.Module, layers: Sequence[nn.Module]) -> str | None:
    """Why a model's micro-batches cannot be packed (``None``: they can): attention other than SDPA, stages other
    than the architecture table's (the generic path runs the model's own masks), sliding windows or experts
    (their router sums read the padding mask), attention dropout, soft-capped scores."""
    from lightning_roundpipe.models.hf.stages import AttentionStage, DecoderStage, InputStage, MlpStage, OutputStage

    implementation = getattr(model.config, "_attn_implementation", None)
    known = (InputStage, DecoderStage, AttentionStage, MlpStage, OutputStage)
    return (
        f"attention other than SDPA (attn_implementation={implementation!r}: load it with"
        " attn_implementation='sdpa')" if implementation not in ("sdpa", NAME)
        else "stages other than the architecture table's (it takes the generic path)"
        if not all(isinstance(layer, known) for layer in layers)
        else "sliding-window attention" if any(getattr(layer, "sliding", False) for layer in layers)
        else "mixture-of-experts blocks" if any(getattr(layer, "router", None) for layer in layers)
        else "attention dropout (its attention_dropout is set)" if getattr(model.config, "attention_dropout", 0.0)
        else "soft-capped attention scores (attn_logit_softcapping)"
        if getattr(model.config, "attn_logit_softcapping", None)
        else None
    )  # fmt: skip


def check_packable(model: nn.Module, layers: Sequence[nn.Module]) -> None:
    """A clear error at setup for ``split_by="packed"`` on a model whose micro-batches cannot be packed."""
    why = packable(model, layers)
    if why is not None:
        raise ValueError(
            f"RoundPipeStrategy(split_by='packed') cannot pack this model's micro-batches: it has {why}. Use"
            " split_by='auto'."
        )


def _check_implementation(implementation: str | None) -> None:
    if implementation not in ("sdpa", NAME):
        raise ValueError(
            "RoundPipeStrategy(split_by='packed') runs attention sequence by sequence in place of SDPA; this model"
            f" uses attn_implementation={implementation!r}. Load it with attn_implementation='sdpa' or use"
            " split_by='auto'."
        )
