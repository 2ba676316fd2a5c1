"""Splitting a batch into micro-batches along dim 0, and the weight of each micro-batch in the batch loss."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_flatten_with_path, tree_unflatten

Reduction = Literal["mean", "sum"] | Callable[[Any], Any]
"""How the loss of a whole batch is made of micro-batch losses.

- ``"mean"``: ``loss_fn`` averages over samples (dim 0); a micro-batch of ``n`` samples out of ``B``
  weighs ``n / B``. Exact for e.g. ``F.mse_loss`` and ``F.cross_entropy`` without ignored targets.
- ``"sum"``: ``loss_fn`` sums; every micro-batch weighs 1.
- a callable ``count(target_microbatch)``: ``loss_fn`` averages over the items ``count`` counts; a
  micro-batch weighs ``count / total count``, e.g. ``lambda t: (t != -100).sum()`` for token losses
  with an ignore index, which is how Hugging Face normalises over ``num_items_in_batch``.
"""


Split = Callable[[Any, Any, int], tuple[list[Any], list[Any]]]
"""``split(inputs, target, num)``: the inputs and targets of ``num`` micro-batches, in place of :func:`split_batch`
(a Hugging Face model's micro-batches by tokens). Its micro-batches' losses are weighted as any (the reduction)."""


def input_elements(tree: Any) -> int:
    """A batch's size in input elements: its largest tensor's (tokens, for a language model's ids and labels).
    The largest, not the sum: a micro-batch whose padding mask was dropped (all ones) holds as many tokens as
    one that kept it, and the planner measures costs per element."""
    return max((t.numel() for t in tree_flatten(tree)[0] if isinstance(t, Tensor)), default=0)


def batch_size(tree: Any, what: str) -> int:
    """The common dim-0 size of every tensor in ``tree``; a clear error if there is none or they differ."""
    leaves_with_paths, _ = tree_flatten_with_path(tree)
    sizes = {}
    for path, leaf in leaves_with_paths:
        if isinstance(leaf, Tensor):
            if leaf.dim() == 0:
                raise ValueError(
                    f"cannot split {what} into micro-batches: the tensor at {_path(path)} is a scalar;"
                    " every tensor must have the batch dimension first"
                )
            sizes[_path(path)] = leaf.shape[0]
    if not sizes:
        raise ValueError(f"cannot split {what} into micro-batches: it holds no tensor (got {type(tree).__name__})")
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{p}: {n}" for p, n in sizes.items())
        raise ValueError(
            f"cannot split {what} into micro-batches: tensors disagree on the batch size (dim 0): {listed}"
        )
    return next(iter(sizes.values()))


def samples_of(inputs: Any, target: Any, split: Split | None) -> int:
    """A batch's samples: its rows (dim 0), or what ``split`` counts where it counts otherwise (a flattened
    language-model batch's sequences, ``split.samples(inputs, target)``); the most micro-batches it makes."""
    rows = batch_size(inputs, "the inputs")
    counted = getattr(split, "samples", None)
    sequences = counted(inputs, target) if counted is not None else None
    return rows if sequences is None else sequences


def split(tree: Any, num: int) -> list[Any]:
    """Split every tensor of ``tree`` into ``num`` dim-0 chunks whose sizes differ by at most one;
    other leaves are shared by all chunks."""
    leaves, spec = tree_flatten(tree)
    chunks = [torch.tensor_split(leaf, num) if isinstance(leaf, Tensor) else None for leaf in leaves]
    return [
        tree_unflatten([c[i] if c is not None else leaf for c, leaf in zip(chunks, leaves)], spec) for i in range(num)
    ]


def cut(split: Split, inputs: Any, target: Any, num: int, how: str) -> tuple[list[Any], list[Any]]:
    """``split``'s ``num`` micro-batches, refused here if it made another count (the schedule has ``num``: a
    micro-batch beyond it would never run, and its loss would be missing only at the batch's end)."""
    micro_inputs, micro_targets = split(inputs, target, num)
    if len(micro_inputs) != num or len(micro_targets) != num:
        raise RuntimeError(
            f"internal error: {type(split).__name__} cut a batch into {len(micro_inputs)} micro-batches"
            f" ({len(micro_targets)} targets) for {how}"
        )
    return micro_inputs, micro_targets


def split_batch(inputs: Any, target: Any, num: int, how: str) -> tuple[list[Any], list[Any]]:
    """Split inputs and target into ``num`` micro-batches; ``how`` names the settings in errors."""
    n = batch_size(inputs, "the inputs")
    if target is not None:
        n_target = batch_size(target, "the target")
        if n_target != n:
            raise ValueError(f"inputs hold {n} samples but the target holds {n_target}; they must match")
    if n < num:
        raise ValueError(
            f"a batch of {n} samples cannot be split into {num} micro-batches ({how}). Use a batch size of at"
            f" least {num} (a multiple of {num} keeps micro-batches equal), or fewer micro-batches."
        )
    targets = split(target, num) if target is not None else [None] * num
    return split(inputs, num), targets


def microbatch_weights(targets: list[Any], inputs: list[Any], reduction: Reduction) -> list[float]:
    """Weight of each micro-batch's loss in the batch loss, so that the weighted sum equals the loss
    ``loss_fn`` would give on the whole batch (see :data:`Reduction`)."""
    if reduction == "sum":
        return [1.0] * len(targets)
    if reduction == "mean":
        counts = [float(batch_size(x, "the inputs")) for x in inputs]
    elif callable(reduction):
        counts = [float(reduction(t)) for t in targets]
        if any(c < 0 for c in counts):
            raise ValueError(f"the `reduction` count function returned a negative count: {counts}")
    else:
        raise ValueError(f"reduction={reduction!r} is not one of 'mean', 'sum' or a count function")
    total = sum(counts)
    if total == 0:
        return [0.0] * len(counts)
    return [c / total for c in counts]


def _path(path: tuple[Any, ...]) -> str:
    return "".join(str(k) for k in path) or "<root>"
