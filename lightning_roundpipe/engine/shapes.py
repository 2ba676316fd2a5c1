"""What the micro-batches of recent batches would hold at any micro-batch count: the padding a count leaves.

A padded batch of varied lengths cut by tokens (:class:`~lightning_roundpipe.models.hf.TokenSplit`) keeps
less padding the more micro-batches it is cut into: each is trimmed to its own longest row. Planned from
the elements per sample measured at one count, fewer micro-batches look cheaper than they are (on an H200,
32 rows of 256..4096 tokens in 2 micro-batches held 47% more elements than real tokens, their time and
memory both planned for 3%). A split that can say what a batch's micro-batches would hold at any count
(``split.sizes(inputs, target)``, a function of the count) lets the planner use the real sizes instead.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

SizesAt = Callable[[int], list[int]]
"""For one batch: micro-batch count -> each micro-batch's input elements."""

REMEMBERED = 32
"""Batches whose shapes are kept (the planner's times are for their mean, its memory for their largest)."""


class BatchShapes:
    """The last :data:`REMEMBERED` batches' micro-batch sizes as functions of the count, each evaluated once
    per count."""

    def __init__(self) -> None:
        self._batches: deque[tuple[SizesAt, dict[int, list[int]]]] = deque(maxlen=REMEMBERED)

    def __len__(self) -> int:
        return len(self._batches)

    def note(self, split: Any, inputs: Any, target: Any) -> bool:
        """Remember a batch, where its split can say what any count would make of it; returns whether it could."""
        sizes = getattr(split, "sizes", None)
        at = sizes(inputs, target) if sizes is not None else None
        if at is not None:
            self._batches.append((at, {}))
        return at is not None

    def newest_largest(self, count: int) -> int:
        """The largest micro-batch of the batch remembered last, cut into ``count``."""
        return max(self._sizes(*self._batches[-1], count))

    def at(self, count: int) -> tuple[float, float] | None:
        """Input elements of a micro-batch when each remembered batch is cut into ``count``: the mean over all
        their micro-batches and the largest; ``None`` with nothing remembered."""
        if not self._batches:
            return None
        sizes = [size for at, seen in self._batches for size in self._sizes(at, seen, count)]
        return sum(sizes) / len(sizes), float(max(sizes))

    @staticmethod
    def _sizes(at: SizesAt, seen: dict[int, list[int]], count: int) -> list[int]:
        if count not in seen:
            seen[count] = at(count)
        return seen[count]


class MicrobatchSizes:
    """Mixed into :class:`~lightning_roundpipe.engine.planner.AutoPlanner`: the input elements its plans are
    for, from the batches measured (and where the split says so, from :class:`BatchShapes`)."""

    batch_samples: int
    shapes: BatchShapes

    def _reset_sizes(self) -> None:
        self.mean_elements = 0.0  # input elements a sample brings to its micro-batch, over the batches measured
        self.row_elements = 0.0  # the widest sample seen (a padded batch's length): memory is planned for no more
        self.spread = 1.0  # the measured batches' largest micro-batch over their mean (elements): memory's margin
        self._measured = [0.0, 0.0, 0.0]  # elements, samples and the widest sample of the batches measured

    def _record_sizes(self, sizes: list[float], samples: int, sample_elements: float) -> None:
        """A measuring batch's micro-batch sizes, of ``samples`` whose widest holds ``sample_elements``."""
        self._measured[:2] = [self._measured[0] + sum(sizes), self._measured[1] + samples]
        self.mean_elements = self._measured[0] / self._measured[1]
        self.spread = max(self.spread, max(sizes) * len(sizes) / sum(sizes))
        self.row_elements = max(self.row_elements, sample_elements or self.mean_elements)
        self._measured[2] = self.row_elements

    def measured_sizes(self) -> list[float]:
        """What micro-batch sizes are estimated from (mean, widest, spread, widest measured), for a checkpoint."""
        return [self.mean_elements, self.row_elements, self.spread, self._measured[2]]

    def restore_sizes(self, saved: list[float]) -> None:
        self.mean_elements, self.row_elements, self.spread, self._measured[2] = map(float, saved)

    def sizes_for(self, samples: float, batch: float = 0.0) -> tuple[float, float]:
        """Input elements of a micro-batch of ``samples`` (of batches of ``batch``): on average (times) and of
        the largest (memory). Where the split says what recent batches' micro-batches hold at that count
        (:class:`BatchShapes`), those; else the measured mean per sample, grown with the widest sample since,
        and the largest as the mean times the measured batches' largest over their mean."""
        batch = batch or self.batch_samples
        if batch and samples and (shaped := self.shapes.at(max(1, round(batch / samples)))) is not None:
            return shaped
        fill = self.mean_elements / self._measured[2] if self._measured[2] else 1.0
        mean = samples * fill * self.row_elements if self.row_elements else samples * self.mean_elements
        return mean, mean * self.spread
