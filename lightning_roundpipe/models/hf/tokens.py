"""Micro-batches by tokens: a padded batch cut into micro-batches of similar lengths, each trimmed to its own
longest sequence, their costs balanced.

A fine-tuning batch is padded to its longest sequence; split by samples, every micro-batch carries that
padding through every layer. Grouped by length instead, a micro-batch of short sequences drops the padding
columns none of its rows needs. Only trailing columns go, and only where every row of the micro-batch has
them as padding (mask 0) with no label (-100): causality keeps earlier tokens from attending to them and no
loss term reads them, so the loss and gradients are plain training's up to summation order. A leading
padding column (left padding) stays: a padded position predicting the first token is part of the loss
there. The batch's loss is still normalised over all its counted tokens (the micro-batches' weights). Where
what padding remains in a micro-batch is all at its rows' ends and unlabelled, the padding mask itself is
left out (:func:`trailing_padding`): the causal mask alone gives the real tokens the same attention.

Costs are balanced, not rows: a micro-batch of ``n`` rows padded to ``L`` tokens costs about
``n * L * (1 + L / span)``, where ``span`` is where attention's cost, growing with the length, equals the
per-token work of the layers' matrices (for a decoder block about its parameters over its width).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_roundpipe.models.hf.attention import plain_inputs
from lightning_roundpipe.models.hf.labels import IGNORE_INDEX
from lightning_roundpipe.models.hf.packed import Piece, pack, sequences

Inputs = tuple[Tensor, Tensor | None, Tensor | None, Tensor]


class TokenSplit:
    """``split(inputs, target, num)``: the ``(inputs, targets)`` of ``num`` micro-batches by tokens (see the
    module docstring); the engine calls it in place of its split by samples. A flattened batch (transformers'
    ``DataCollatorWithFlattening``: sequences end to end in a row, positions restarting, no padding mask) is cut
    between its sequences into packed micro-batches where the model can run them; any other batch without a
    padding mask (rows all full) is split by samples."""

    width_multiple = 1
    """Each micro-batch's width rounded up to a multiple of this (capped at the batch's): shapes then repeat from
    batch to batch (cuDNN's attention builds a graph per new shape); the added columns are trailing padding."""

    def __init__(self, span: float = math.inf, packed: bool = False, unpackable: str | None = None) -> None:
        self.span = span
        """Tokens at which attention costs as much as the rest of a layer, per token (``inf``: never)."""
        self.packed = packed
        """Each micro-batch's sequences end to end in one row, unpadded (:mod:`.packed`), where the batch is
        right-padded with no label on its padding; a group then costs the sum of its rows' costs."""
        self.unpackable = unpackable
        """Why the model's micro-batches cannot be packed (``None``: they can): a flattened batch then runs
        as its rows, with transformers' mask over each whole row."""
        self.pack_unpadded = True
        """Packed also where a batch has no padding (``split_by="packed"``); ``False`` under ``"auto"``, where a
        batch of one length keeps the rows it was measured with (packing removes no padding there)."""
        self._warned: set[str] = set()
        self._last: tuple[Tensor, Tensor, list[Piece] | None] | None = None

    @classmethod
    def for_model(cls, model: nn.Module, packed: bool = False, unpackable: str | None = None) -> TokenSplit:
        """The split for a causal LM: ``span`` is a decoder block's parameters over the model's hidden size (its
        base model's largest ``ModuleList``; all experts counted for a mixture: attention then weighs a little
        less); without them, lengths alone."""
        hidden = getattr(getattr(model, "config", None), "hidden_size", None)
        base = getattr(model, getattr(model, "base_model_prefix", ""), None)
        lists = [m for m in base.children() if isinstance(m, nn.ModuleList) and len(m)] if base is not None else []
        if not lists or not hidden:
            return cls(packed=packed, unpackable=unpackable)
        blocks = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
        return cls(sum(p.numel() for p in blocks[0].parameters()) / hidden, packed, unpackable)

    def cost(self, rows: int, length: int) -> float:
        return rows * length * (1.0 + length / self.span)

    def __call__(self, inputs: Inputs, target: Tensor, num: int) -> tuple[list[Inputs], list[Tensor]]:
        input_ids, attention_mask, position_ids, labels = inputs
        if not _by_tokens(inputs, target):
            pieces = self._flattened(inputs, target)
            if pieces is None:
                return _by_samples(inputs, num)
            return self._packed(input_ids, labels, pieces, num, position_ids)
        lengths = kept_lengths(attention_mask, labels)
        listed = lengths.tolist()
        if self._packs(inputs):
            return self._packed(input_ids, labels, [(r, 0, n) for r, n in enumerate(listed)], num)
        groups = self.groups(listed, num)
        micro_inputs, micro_targets = [], []
        for rows in groups:
            index = torch.tensor(rows, dtype=torch.long)
            length = self._width(int(lengths[index].max()), input_ids.shape[1])
            ids, mask, positions, micro_labels = (
                None if t is None else t.index_select(0, index)[:, :length]
                for t in (input_ids, attention_mask, position_ids, labels)
            )
            mask, positions = plain_inputs(mask, positions)
            if mask is not None and positions is None and trailing_padding(mask, micro_labels):
                mask = None  # the causal mask alone is exact here (see the module docstring)
            micro_inputs.append((ids, mask, positions, micro_labels))
            micro_targets.append(micro_labels)
        return micro_inputs, micro_targets

    def _packed(
        self, input_ids: Tensor, labels: Tensor, pieces: list[Piece], num: int, positions: Tensor | None = None
    ) -> tuple[list[Inputs], list[Tensor]]:
        groups = self.groups([n for _, _, n in pieces], num, packed=True)
        micro = [pack(input_ids, labels, [pieces[i] for i in group], positions) for group in groups]
        return micro, [m[3] for m in micro]  # type: ignore[misc]

    def samples(self, inputs: Inputs, target: Tensor) -> int | None:
        """A flattened batch's sequences, which the engine counts as its samples (``None``: its rows are)."""
        pieces = self._flattened(inputs, target)
        return None if pieces is None else len(pieces)

    def sizes(self, inputs: Inputs, target: Tensor) -> Callable[[int], list[int]] | None:
        """What this batch's micro-batches would hold (input elements) at any count, without cutting it: the
        planner's padding at counts it has not run (``None``: a batch split by samples)."""
        _, attention_mask, _, labels = inputs
        if not _by_tokens(inputs, target):
            pieces = self._flattened(inputs, target)
            if pieces is None:
                return None
            return functools.partial(self._elements, [n for _, _, n in pieces], width=0, packed=True)
        lengths, packed = kept_lengths(attention_mask, labels).tolist(), self._packs(inputs)
        return functools.partial(self._elements, lengths, width=labels.shape[1], packed=packed)

    def _elements(self, lengths: list[int], num: int, width: int, packed: bool) -> list[int]:
        groups = self.groups(lengths, max(1, min(num, len(lengths))), packed)
        if packed:
            return [sum(lengths[r] for r in rows) for rows in groups]
        return [len(rows) * self._width(max(lengths[r] for r in rows), width) for rows in groups]

    def _flattened(self, inputs: Inputs, target: Tensor) -> list[Piece] | None:
        """A flattened batch's sequences, where it is one (rows holding several sequences, told by positions
        that restart, and no padding mask: transformers' mask functions read such rows the same way) and its
        micro-batches can be packed; ``None`` otherwise. Cut between two sequences, the first token of the
        second loses the previous token's prediction of it: exact where that label is -100 (the collator's
        default separator) and nothing is cut otherwise. Read once per batch (the engine asks three times)."""
        input_ids, attention_mask, position_ids, labels = inputs
        if attention_mask is not None or position_ids is None or target is not labels:
            return None
        last = self._last
        if last is not None and last[0] is position_ids and last[1] is labels:
            return last[2]
        pieces = self._read_flattened(input_ids, position_ids, labels)
        self._last = (position_ids, labels, pieces)
        return pieces

    def _read_flattened(self, input_ids: Tensor, position_ids: Tensor, labels: Tensor) -> list[Piece] | None:
        if position_ids.shape != input_ids.shape or labels.shape != input_ids.shape:
            return None
        pieces = sequences(position_ids)
        if len(pieces) == input_ids.shape[0]:
            return None  # a sequence per row: the rows are the samples
        why = self.unpackable
        cut = [(r, a) for r, a, _ in pieces if a > 0]
        if why is None and cut and bool((labels[[r for r, _ in cut], [a for _, a in cut]] != IGNORE_INDEX).any()):
            why = "a sequence's first token has a label (the collator's separator_id=-100 gives it none)"
        if why is not None:
            if why not in self._warned:
                self._warned.add(why)
                warnings.warn(
                    f"roundpipe: a flattened batch (several sequences in a row, positions restarting) is not cut"
                    f" between its sequences: {why}. Each row runs as one micro-batch, with transformers' mask"
                    " over the whole row.",
                    stacklevel=3,
                )
            return None
        return pieces

    def _packs(self, inputs: Inputs) -> bool:
        """Whether this batch's micro-batches are packed: asked for, right padding without labels on it,
        positions of their own (``0..T-1``, left out by :func:`plain_inputs`), and (unless
        :attr:`pack_unpadded`) some padding to remove."""
        _, attention_mask, position_ids, labels = inputs
        if not (self.packed and position_ids is None and trailing_padding(attention_mask, labels)):
            return False
        return self.pack_unpadded or not bool(attention_mask.all())

    def _width(self, length: int, width: int) -> int:
        return min(width, -(-length // self.width_multiple) * self.width_multiple)

    def groups(self, lengths: list[int], num: int, packed: bool = False) -> list[list[int]]:
        """``num`` groups of row indices, rows of similar lengths together (longest first), the largest group
        cost as small as contiguous runs of the rows sorted by length allow (``packed``: a group costs its
        rows' costs, unpadded)."""
        if num < 1 or num > len(lengths):
            raise ValueError(f"cannot cut {len(lengths)} rows into {num} micro-batches")
        order = sorted(range(len(lengths)), key=lambda r: (-lengths[r], r))
        low = max(self.cost(1, lengths[r]) for r in order)
        high = self._run_cost(order, lengths, packed)
        for _ in range(40):  # the smallest cap whose greedy runs number at most `num` (to a 1e-12 fraction)
            middle = (low + high) / 2
            if len(self._runs(order, lengths, middle, packed)) <= num:
                high = middle
            else:
                low = middle
        runs = self._runs(order, lengths, high, packed)
        while len(runs) < num:  # fewer runs than micro-batches: the costliest run with two rows or more halves
            i = max(
                (i for i, run in enumerate(runs) if len(run) > 1),
                key=lambda i: self._run_cost(runs[i], lengths, packed),
            )
            run = runs.pop(i)
            runs[i:i] = [run[: len(run) // 2], run[len(run) // 2 :]]
        return runs

    def _runs(self, order: list[int], lengths: list[int], cap: float, packed: bool) -> list[list[int]]:
        runs: list[list[int]] = []
        total = 0.0  # the last run's cost, packed
        for r in order:
            alone = self.cost(1, lengths[r])
            if packed:
                grown = total + alone
            elif runs:  # rows sorted longest first: the run's first row is its longest
                grown = self.cost(len(runs[-1]) + 1, lengths[runs[-1][0]])
            if runs and grown <= cap:
                runs[-1].append(r)
                total = grown
            else:
                runs.append([r])
                total = alone
        return runs

    def _run_cost(self, run: list[int], lengths: list[int], packed: bool = False) -> float:
        if packed:  # added up as `_runs` adds them: `sum` compensates its rounding from Python 3.12 on, and a cap
            total = 0.0  # a hair below the running total cut the whole batch into two micro-batches (H200, 3.12)
            for r in run:
                total += self.cost(1, lengths[r])
            return total
        return self.cost(len(run), max(lengths[r] for r in run))


def _by_tokens(inputs: Inputs, target: Tensor) -> bool:
    """Whether a batch is cut by tokens: a 2-D padding mask, and the loss's target is the batch's labels."""
    attention_mask, labels = inputs[1], inputs[3]
    return attention_mask is not None and attention_mask.dim() == 2 and target is labels


def _by_samples(inputs: Inputs, num: int) -> tuple[list[Inputs], list[Tensor]]:
    """Rows cut into ``num`` runs whose sizes differ by at most one (as the engine's split along dim 0)."""
    if num < 1 or num > inputs[0].shape[0]:
        raise ValueError(f"cannot cut {inputs[0].shape[0]} rows into {num} micro-batches")
    parts = [torch.tensor_split(t, num) if t is not None else [None] * num for t in inputs]
    micro = [tuple(part[i] for part in parts) for i in range(num)]
    return micro, [m[3] for m in micro]  # type: ignore[misc]


def kept_lengths(attention_mask: Tensor, labels: Tensor) -> Tensor:
    """Per row, the columns a micro-batch must keep: up to the last one that is attended or has a label (the
    trailing ones after it are padding no loss term reads)."""
    needed = attention_mask.bool() | (labels != IGNORE_INDEX)
    columns = torch.arange(1, needed.shape[1] + 1)
    return (needed * columns).amax(dim=1).clamp_min(1)


def trailing_padding(attention_mask: Tensor, labels: Tensor) -> bool:
    """Whether every row's padding comes after its tokens (right padding) and no padded position has a label. The
    causal mask alone then gives every real token the same attention as the padding mask (a token sees only
    earlier ones, all real), and the padded positions, whose outputs differ, enter no loss term: the mask can be
    left out. Made from the padding mask, it cost transformers' mask functions 60-110 ms of host time per
    micro-batch and stage on an H200 (the device idle meanwhile); without it, SDPA runs its causal kernels."""
    if attention_mask.dim() != 2 or attention_mask.shape[1] < 2:
        return attention_mask.dim() == 2
    mask = attention_mask.bool()
    return bool((mask[:, 1:] <= mask[:, :-1]).all()) and bool((labels[~mask] == IGNORE_INDEX).all())


def padding_tokens(micro_inputs: Sequence[Any], real_tokens: int) -> int:
    """Padded positions the micro-batches of a batch of ``real_tokens`` carry (a mask left out counts too)."""
    return sum(ids.numel() for ids, *_ in micro_inputs) - real_tokens
