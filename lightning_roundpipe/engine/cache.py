"""The devices' caching allocators, watched between batches: a plan whose stages fit the planner's memory
model but not the card beside the allocator's caches.

PyTorch's caching allocator keeps a cache per stream. A worker computes on one stream and moves activations
and gradients on others, so the memory it holds nears the sum of each stream's peak, not the peak of their
sum that stages are planned for (the weights' buffers, the largest transfers, come from the compute stream's
pool since 2026-12-07: ``runtime/uploads.py``). Under the card's limit (its size, or a
``torch.cuda.set_per_process_memory_fraction`` cap) the allocator then serves requests by freeing cached
blocks: a ``cudaFree`` each time, which waits for every kernel and copy queued on the device, and the
device idles until the worker catches up. Measured on one H200 capped at 24 GiB (Qwen3-1.7B shape,
32 x 2048 tokens per step, docs/benchmarks.md, 2026-12-02): at ``gpu_memory=0.8`` 460 frees in six steps,
34,701 tokens/s; planned for 0.6 of the card none, 37,505.

Frees are a symptom, not the cost: on the same card the Qwen3-8B shape kept freeing on ever smaller stages
and ran slower on each (9,166 tokens/s on its first plan, 7,614 after three lowerings). So a lowering is a
trial: :class:`CacheWatch` times the smaller plan's batches (seconds per token between dispatches), then the
plan before it again (after, so that anything that still speeds the run up by itself cannot favour the
plan timed later), and keeps the smaller plan only when it was faster; otherwise the larger plan stays and
the watch stops.

Varying shapes (a language model's batches of changing lengths) leave blocks of sizes later batches never
ask for: the allocator's reserve crept up to 21.6 GiB on a card capped at 24 GiB whose plan was for 19.2
(Qwen3-1.7B shape, 8 sequences of 256-4096 tokens a step, 2026-12-04). So after a batch that left a device's
allocator holding more than the limit the user allowed (``gpu_memory`` of the card), the cache goes back
(:meth:`CacheWatch.release_over_limit`). Done by a callback there: 4 times in 34 batches, NVML's peak 21.05 GiB
against 22.96, 0.995x the speed. Those frees are the watch's own, not the plan's pressure.
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from lightning_roundpipe.engine.planner import AutoPlanner, snapshot
from lightning_roundpipe.runtime.callers import outside_package
from lightning_roundpipe.runtime.device import WorkerDevice
from lightning_roundpipe.runtime.host_store import HostStore
from lightning_roundpipe.schedule.plan import StagePlan


@dataclass(frozen=True)
class _Trial:
    """A smaller plan on trial: the plan, micro-batch count and limit before it and the limit tried, the
    factors between them, and the tried plan's seconds per input element once timed (then the plan before it
    runs again to be timed)."""

    plan: StagePlan
    count: int
    limit: float
    tried: float
    steps: int
    pace: float | None = None


class CacheWatch:
    """Whether the running plan keeps making the devices' allocators give memory back, and whether
    planning for less memory then pays."""

    settle = 2
    """Batches on a new plan not judged: the caches let go of the old plan's block sizes first."""
    patience = 2
    """Intervals between batches in a row with frees before a smaller plan is tried."""
    window = 4
    """Intervals between dispatches a plan's pace is taken over (before a trial, and on trial)."""
    gain = 0.03
    """How much less time per input element a smaller plan must take to be kept (timing noise stays under it)."""
    factor = 0.75
    """What the memory limit is multiplied by for a trial (0.8 of a card becomes 0.6, then 0.45)."""
    limit = 3
    """Factors taken at most, kept or not: the limit never goes under ``factor ** limit`` of where it began."""

    def __init__(
        self,
        devices: Sequence[WorkerDevice],
        planner: AutoPlanner,
        store: HostStore,
        clock: Callable[[], float] = time.perf_counter,
        ceiling: float | None = None,
    ) -> None:
        self.devices = list(devices)
        self.planner, self.store, self.clock = planner, store, clock
        self.ceiling = planner.memory_limit if ceiling is None else ceiling
        """The memory the user allowed each device (bytes; ``None``: no limit): what the plan began under (with
        the optimizer on the device, that and its states), not a trial's lower limit."""
        self.releases = 0
        """Caches given back after a batch that left an allocator holding more than :attr:`ceiling`."""
        self._own = 0  # the allocators' frees those releases made
        self.lowered = 0
        """Factors of :attr:`factor` the memory limit was lowered by and kept."""
        self.reverted = False
        """A smaller plan was tried and was not faster than the plan before it, which stays."""
        self.stopped = False
        """Nothing more is tried in this run (a trial failed, nothing smaller fits, or the plan is fixed)."""
        self.trials: list[dict[str, float | bool]] = []
        """Each judged trial: the limits (GiB), both plans' seconds per input element, and whether it was kept."""
        self._trial: _Trial | None = None
        self._tried = 0
        self._last: int | None = None
        self._streak = 0
        self._times: deque[list[float]] = deque(maxlen=self.window + 1)  # [dispatch time, samples, call, work]

    def forget(self) -> None:
        """The interval up to the next batch is not judged (an evaluation pass ran in it)."""
        self._last, self._streak = None, 0
        self._times.clear()

    def next_plan(self, call: int, samples: int) -> StagePlan | None:
        """Called before batch ``call`` (of ``samples``) is dispatched: the plan to switch to (a smaller one
        to try, or the one before a trial that did not pay), with a warning saying why; ``None`` to stay."""
        self.release_over_limit()
        now, releases = self.clock(), self._frees() - self._own
        last, self._last = self._last, releases
        planner = self.planner
        if planner.measuring:  # the planner measures the layers again and plans under its limit after
            if self._trial is not None:
                planner.memory_limit, self._trial = self._trial.limit, None
            self._streak = 0
            self._times.clear()
            return None
        if call - planner.plan_since < self.settle:
            self._streak = 0
            self._times.clear()
            return None
        self._times.append([now, samples, call, 0.0])
        if len(self._times) > 1:  # the interval that just ended ran on this plan, settled
            self._streak = self._streak + 1 if last is not None and releases > last else 0
        if self.stopped or len(self._times) <= self.window:  # (stopped: still timed, for :meth:`pace`)
            return None
        if self._trial is not None:
            return self._judge(self._trial)
        if self._streak >= self.patience:
            return self._lower()
        return None

    def release_over_limit(self) -> int:
        """Give back the cache of each device whose allocator holds more than :attr:`ceiling` (a ``cudaFree`` per
        cached block, each waiting for the device's queued work: rare, as the reserve creeps slowly). Returns how
        many devices did."""
        over = [d for d in self.devices if self.ceiling is not None and d.reserved() > self.ceiling]
        if over:
            before = self._frees()
            for device in over:
                device.release_cached()
            self._own += self._frees() - before
            self.releases += len(over)
        return len(over)

    def _frees(self) -> int:
        return sum(device.cache_releases() for device in self.devices)

    def settled(self) -> tuple[StagePlan, int, float | None]:
        """The plan, micro-batch count and memory limit the run has settled on: during a trial, those
        before it (what a checkpoint saves, so that a resumed run does not keep a plan never judged)."""
        if self._trial is not None:
            return self._trial.plan, self._trial.count, self._trial.limit
        planner = self.planner
        return planner.plan, planner.microbatches_per_round, planner.memory_limit

    def ran(self, call: int, elements: float) -> None:
        """Batch ``call``, just dispatched, holds ``elements`` input elements in its micro-batches (tokens, for a
        language model, padding trimmed): the work its interval is timed by."""
        if self._times and self._times[-1][2] == call:
            self._times[-1][3] = elements

    def pace(self) -> float | None:
        """Seconds per input element over the last :attr:`window` settled intervals of the running plan, not on
        trial; ``None`` until there are that many (and from a dispatch that switched plans until the next, which
        clears the old plan's window)."""
        return self._pace() if self._settled() else None

    def interval(self, intervals: int | None = None) -> float | None:
        """Seconds per batch between dispatches over the last ``intervals`` settled intervals (default: the same
        window as :meth:`pace`; ``None`` where there are fewer, or where the pace is): a batch's wall time on the
        running plan, waits included."""
        intervals = self.window if intervals is None else intervals
        if intervals > self.window or not self._settled(intervals):  # (more than the times kept)
            return None
        return (self._times[-1][0] - self._times[-1 - intervals][0]) / intervals

    def _settled(self, intervals: int | None = None) -> bool:
        intervals = self.window if intervals is None else intervals
        running = self._trial is None and len(self._times) > intervals >= 1
        return running and self._times[-1 - intervals][2] >= self.planner.plan_since

    def _pace(self) -> float:
        """Seconds per unit of work between the first and the last dispatch of the window: per input element
        where the batches said (:meth:`ran`; a language model's batches differ in length), else per sample."""
        times = list(self._times)
        per_element = all(work for *_, work in times[:-1])
        work = sum(entry[3] if per_element else entry[1] for entry in times[:-1])
        return (times[-1][0] - times[0][0]) / max(1e-30, work)

    def _lower(self) -> StagePlan | None:
        """The first plan (or micro-batch count) that differs from the running one under a lower limit."""
        planner, self._streak = self.planner, 0
        before, running = planner.memory_limit, (planner.plan, planner.microbatches_per_round)
        limit, steps, restore = before, 0, snapshot(planner)
        while before is not None and limit is not None and self._tried + steps < self.limit:
            steps += 1
            plan = planner.plan_for_memory(self.store, self.factor * limit)
            if plan is None:
                break
            if (plan, planner.microbatches_per_round) != running:
                self._trial, self._tried = _Trial(*running, before, planner.memory_limit, steps), self._tried + steps
                return plan
            limit = planner.memory_limit
        restore()  # the same plan under every lower limit, or none fits: as it runs (choosing again is no restore)
        self.stopped = True
        if self._tried == 0:
            warnings.warn(
                f"{self._what()} The plan stays (no measured layers to plan from again, or nothing smaller fits):"
                " pass a plan with smaller stages or a lower RoundPipeStrategy(gpu_memory=...); docs/tuning.md.",
                stacklevel=outside_package(),
            )
        return None

    def _judge(self, trial: _Trial) -> StagePlan | None:
        """After :attr:`window` settled intervals: on the tried plan, time it and go back to the plan before
        it; on that plan again, keep the tried one (switch to it) when it was faster, else stay and stop."""
        planner, pace = self.planner, self._pace()
        if trial.pace is None:
            self._trial = replace(trial, pace=pace)
            return planner.plan_for_memory(self.store, trial.limit)
        self._trial = None
        now, before = trial.tried / 2**30, trial.limit / 2**30
        kept = trial.pace <= (1 - self.gain) * pace
        self.trials.append(
            {"tried_gib": now, "before_gib": before, "tried_s": trial.pace, "before_s": pace, "kept": kept}
        )
        if kept:
            self.lowered += trial.steps
            warnings.warn(
                f"{self._what()} Stages planned for {now:.1f} GiB instead of {before:.1f} GiB ran"
                f" {1 - trial.pace / pace:.0%} faster per token: kept (RoundPipeStrategy(gpu_memory=...) sets"
                " where this starts).",
                stacklevel=outside_package(),
            )
            return planner.plan_for_memory(self.store, trial.tried)
        self.reverted = self.stopped = True
        warnings.warn(
            f"{self._what()} Stages planned for {now:.1f} GiB instead of {before:.1f} GiB were not faster"
            f" ({trial.pace * 1e6:.3g} against {pace * 1e6:.3g} s per million tokens): the plan for {before:.1f} GiB"
            " stays, not tried again in this run.",
            stacklevel=outside_package(),
        )
        return None

    def _what(self) -> str:
        return (
            f"roundpipe: the caching allocator gave device memory back in each of the last {self.patience}"
            " batches (each time the device waits for all its queued work)."
        )
