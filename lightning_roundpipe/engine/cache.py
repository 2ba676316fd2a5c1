"""The devices' caching allocators, watched between batches: a plan whose stages fit the planner's memory
model but not the card beside the allocator's caches.

PyTorch's caching allocator keeps a cache per stream. A worker uploads weights on one stream, computes on
another and downloads gradients on a third, so the memory it holds nears the sum of each stream's peak,
not the peak of their sum that stages are planned for. Under the card's limit (its size, or a
``torch.cuda.set_per_process_memory_fraction`` cap) the allocator then serves requests by freeing cached
blocks: a ``cudaFree`` each time, which waits for every kernel and copy queued on the device, and the
device idles until the worker catches up. Measured on one H200 capped at 24 GiB (Qwen3-1.7B shape,
32 x 2048 tokens per step, docs/benchmarks.md, 2026-12-02): at ``gpu_memory=0.8`` 460 frees in six steps,
34,701 tokens/s; planned for 0.6 of the card none, 37,505.

:class:`CacheWatch` counts the frees between two training batches; when the batches of a plan made some
``patience`` times in a row, the plan is chosen again for ``factor`` times the memory, up to ``limit`` times.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from lightning_roundpipe.engine.planner import AutoPlanner
from lightning_roundpipe.runtime.callers import outside_package
from lightning_roundpipe.runtime.device import WorkerDevice
from lightning_roundpipe.runtime.host_store import HostStore
from lightning_roundpipe.schedule.plan import StagePlan


class CacheWatch:
    """Whether the running plan keeps making the devices' allocators give memory back."""

    settle = 2
    """Batches on a new plan not judged: the caches let go of the old plan's block sizes first."""
    patience = 2
    """Intervals between batches in a row with frees before the plan is judged too large."""
    factor = 0.75
    """What the memory limit is multiplied by each time (0.8 of a card becomes 0.6, then 0.45)."""
    limit = 3
    """Times the memory limit is lowered at most; then the plan stays (and one warning says so)."""

    def __init__(self, devices: Sequence[WorkerDevice], planner: AutoPlanner, store: HostStore) -> None:
        self.devices = list(devices)
        self.planner, self.store = planner, store
        self.lowered = 0
        """Times the engine planned for less memory after this watch said so."""
        self._last: int | None = None
        self._streak = 0

    def forget(self) -> None:
        """The interval up to the next batch is not judged (an evaluation pass ran in it)."""
        self._last, self._streak = None, 0

    def stalls(self, call: int, plan_since: int, measuring: bool) -> bool:
        """Called before batch ``call`` is dispatched: ``True`` when the batches since the plan settled freed
        cached device memory in each of the last :attr:`patience` intervals between two calls."""
        now = sum(device.cache_releases() for device in self.devices)
        last, self._last = self._last, now
        if measuring or last is None or call - plan_since < self.settle or self.lowered >= self.limit:
            self._streak = 0
            return False
        self._streak = self._streak + 1 if now > last else 0
        if self._streak < self.patience:
            return False
        self._streak = 0
        return True

    def smaller_plan(self, call: int) -> StagePlan | None:
        """Before batch ``call`` is dispatched: the plan for less memory per stage when :meth:`stalls`, with
        a warning saying why; ``None`` otherwise, and when nothing smaller can be planned (said once)."""
        planner = self.planner
        if not self.stalls(call, planner.plan_since, planner.measuring):
            return None
        self.lowered += 1
        before = planner.memory_limit
        plan = None if before is None else planner.plan_for_memory(self.store, self.factor * before)
        what = f"roundpipe: the caching allocator gave device memory back in each of the last {self.patience} batches"
        if plan is None or before is None or planner.memory_limit is None:
            self.lowered = self.limit  # say it once, then stop watching
            warnings.warn(
                f"{what} (each time the device waits for all its queued work). The plan stays (no measured"
                " layers to plan from again, or nothing smaller fits): pass a plan with smaller stages or a"
                " lower RoundPipeStrategy(gpu_memory=...); docs/tuning.md.",
                stacklevel=outside_package(),
            )
            return None
        warnings.warn(
            f"{what} (each time the device waits for all its queued work): its per-stream caches did not fit"
            f" beside stages planned for {before / 2**30:.1f} GiB. Planning for {planner.memory_limit / 2**30:.1f}"
            " GiB from now on (RoundPipeStrategy(gpu_memory=...) sets where this starts).",
            stacklevel=outside_package(),
        )
        return plan
