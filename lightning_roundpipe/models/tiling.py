"""A token-wise function (an MLP and its norm) over a long sequence, a tile of tokens at a time.

At long sequences one MLP layer's activations bound what fits on a device: for the Qwen3-1.7B shape its
gate, up, activation and product keep 48 of the 68 KiB per token that the MLP half of a block saves
for backward. Since every token is computed alone, the tokens can go through in tiles: the forward
keeps only the layer's input, and the backward recomputes one tile at a time and differentiates it
at once, so a tile's intermediates are all that is ever alive. That costs one more forward of the
function in backward (as activation checkpointing does). Under ``no_grad`` (forward stages,
evaluation) the tiles bound the transient memory the same way.

Not :func:`torch.utils.checkpoint`: :func:`tiled` captures the tensors the module holds at the call and
binds them again for the recompute, under the autocast state of the call, so it does not depend on the
worker keeping the stage's weights bound into the weight-less replicas through the backward (which the
workers do since a layer's own checkpoint needed it, holding the device's generator there too). It draws
no random numbers again: modules that would (dropout in training mode) are refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn


def tiled(
    module: nn.Module, fn: Callable[..., Tensor], x: Tensor, tile_tokens: int | None, side: Tensor | None = None
) -> Tensor:
    """``fn(x)`` for a token-wise ``fn`` (each position along every dimension but the last is computed
    alone), at most ``tile_tokens`` tokens at a time; ``None`` or a sequence that fits in one tile is
    one plain call. A tile keeps ``x``'s rank: all leading dimensions but the last one are 1 (a
    ``(batch, sequence, hidden)`` input gives ``(1, tile, hidden)`` tiles). ``fn`` may use only tensors
    that ``module`` holds (its parameters and buffers): they are the ones bound again for the recompute
    in backward. Random draws are refused where they can be seen (dropout modules in training mode);
    ``fn`` must not draw any other way either (``F.dropout``). ``side``: a tensor of one value per token
    (``x``'s shape without its last dimension, no gradient), cut into the same tiles: ``fn(tile,
    side_tile)``."""
    if side is not None and side.shape != x.shape[:-1]:
        raise ValueError(f"side {tuple(side.shape)} must match the tokens of {tuple(x.shape)}")
    whole = (lambda x: fn(x)) if side is None else (lambda x: fn(x, side))
    if tile_tokens is None:
        return whole(x)
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens={tile_tokens} must be at least 1")
    tokens = x.numel() // x.shape[-1] if x.dim() else 1
    if x.dim() < 2 or tokens <= tile_tokens:
        return whole(x)
    for m in module.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.training and m.p > 0:
            raise ValueError(
                f"cannot tile {type(module).__name__} over tokens: it holds a {type(m).__name__}(p={m.p}) in"
                " training mode, whose masks the recompute of each tile would have to draw again. Set its"
                " probability to 0 (e.g. lora_dropout=0) or do not tile this layer."
            )
    names, tensors = _held(module)
    if not torch.is_grad_enabled() or not (x.requires_grad or any(t.requires_grad for t in tensors)):
        return _forward(fn, x, tile_tokens, side)
    return _Tiled.apply(module, fn, names, tile_tokens, side, x, *tensors)


def _held(module: nn.Module) -> tuple[list[str], list[Tensor]]:
    """The module's parameters and buffers as held now (a replica's bound device tensors, or its own)."""
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return [n for n, _ in named], [t for _, t in named]


def _tokens(x: Tensor) -> Tensor:
    """``x`` as one row of tokens of its own rank: ``(1, ..., 1, tokens, last)``."""
    return x.reshape((1,) * (x.dim() - 2) + (-1, x.shape[-1]))


def _side_tokens(side: Tensor) -> Tensor:
    """``side`` as one row of tokens: ``(1, ..., 1, tokens)``."""
    return side.reshape((1,) * (side.dim() - 1) + (-1,))


def _call(fn: Callable[..., Tensor], tile: Tensor, side: Tensor | None, window: slice) -> Tensor:
    return fn(tile) if side is None else fn(tile, side[..., window])


def _forward(fn: Callable[..., Tensor], x: Tensor, tile_tokens: int, side: Tensor | None = None) -> Tensor:
    """The tiles' outputs written into one buffer as they come: never the tiles and their join at once."""
    rows = _tokens(x)
    sides = None if side is None else _side_tokens(side)
    total, out = rows.shape[-2], None
    for start in range(0, total, tile_tokens):
        y = _call(fn, rows[..., start : start + tile_tokens, :], sides, slice(start, start + tile_tokens))
        if not isinstance(y, Tensor):
            raise TypeError(f"a tiled function must return one tensor per tile, got {type(y).__name__}")
        if out is None:
            out = y.new_empty((*y.shape[:-2], total, y.shape[-1]))
        out[..., start : start + y.shape[-2], :] = y
        del y
    assert out is not None
    return out.view(*x.shape[:-1], out.shape[-1])


@contextlib.contextmanager
def _bound(module: nn.Module, names: list[str], tensors: tuple[Tensor, ...]) -> Iterator[None]:
    """Put ``tensors`` into the module's parameter and buffer slots ``names`` for the duration."""
    previous = []
    for name, tensor in zip(names, tensors):
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        table = owner._parameters if attr in owner._parameters else owner._buffers
        previous.append((table, attr, table[attr]))
        table[attr] = tensor
    try:
        yield
    finally:
        for table, attr, old in reversed(previous):
            table[attr] = old


class _Tiled(torch.autograd.Function):
    """Forward without a graph, tile by tile; backward recomputes and differentiates each tile."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, module: nn.Module, fn: Callable[..., Tensor], names: list[str], tile_tokens: int,
        side: Tensor | None, x: Tensor, *tensors: Tensor,
    ) -> Tensor:  # fmt: skip
        device = x.device.type
        ctx.module, ctx.fn, ctx.names, ctx.tile_tokens = module, fn, names, tile_tokens
        ctx.sides = None if side is None else _side_tokens(side)
        ctx.autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.save_for_backward(x, *tensors)
        return _forward(fn, x, tile_tokens, side)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, *held = ctx.saved_tensors
        device = x.device
        rows = _tokens(x)
        grads_out = _tokens(grad_out)
        grad_x = torch.zeros_like(rows) if ctx.needs_input_grad[5] else None
        wanted = [i for i, t in enumerate(held) if ctx.needs_input_grad[6 + i]]
        sums: dict[int, Tensor] = {}  # low-precision weights sum their tiles' gradients in fp32
        enabled, dtype = ctx.autocast
        # no autocast cache: each tile's weights are new leaves, and a cache would keep every tile's casts
        recompute = torch.autocast(device.type, dtype, enabled=enabled, cache_enabled=False)
        with torch.enable_grad():
            for start in range(0, rows.shape[-2], ctx.tile_tokens):
                window = (..., slice(start, start + ctx.tile_tokens), slice(None))
                tile = rows[window].detach().requires_grad_(grad_x is not None)
                tensors = tuple(t.detach().requires_grad_(i in wanted) for i, t in enumerate(held))
                with _bound(ctx.module, ctx.names, tensors), recompute:
                    out = _call(ctx.fn, tile, ctx.sides, window[-2])
                inputs = ([tile] if grad_x is not None else []) + [tensors[i] for i in wanted]
                grads = torch.autograd.grad(out, inputs, grads_out[window], allow_unused=True)
                if grad_x is not None:
                    if grads[0] is not None:  # None: fn ignored its input
                        grad_x[window] = grads[0]
                    grads = grads[1:]
                for i, g in zip(wanted, grads):
                    if g is None:
                        continue
                    if i in sums:
                        sums[i] += g
                    else:
                        sums[i] = g.float() if g.dtype in (torch.bfloat16, torch.float16) else g.clone()
        weight_grads = [sums[i].to(held[i].dtype) if i in sums else None for i in range(len(held))]
        return (None, None, None, None, None, None if grad_x is None else grad_x.view_as(x), *weight_grads)
