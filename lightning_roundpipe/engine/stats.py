"""What recorded batches say about the running pipeline: busy time, bubbles, host gaps and the handoff.

Read by :class:`~lightning_roundpipe.callbacks.RoundPipeMonitor` and the benchmarks; the handoff also
feeds the planner's prediction. Nothing here changes what the pipeline does.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from statistics import median

from lightning_roundpipe.runtime.device import WorkerDevice
from lightning_roundpipe.runtime.flight import Flight
from lightning_roundpipe.runtime.profile import busy_seconds, timeline
from lightning_roundpipe.schedule.plan import StagePlan


class StepStats:
    """Measurements of the last recorded batch, and the host's share of the time between batches."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.busy: dict[int, float] = {}
        """Per worker, the fraction of the last measured step its device spent computing."""
        self.compute_s: float | None = None
        """Seconds the busiest device computed in the last measured batch."""
        self.bubble_in_step: float | None = None
        """Idle fraction of the workers between the measured batch's first and last kernel: the
        pipeline's own bubble, what the simulator predicts (with one worker, or synchronously; with
        several workers asynchronously, batches overlap and ``busy`` is the one to compare)."""
        self.host_gap: float | None = None
        """Fraction of the step between the measured batch's last kernel and the next batch's first:
        time the devices waited for the host (Lightning's loop, the next batch, its first uploads)."""
        self.last_timeline: list[tuple[int, str, float, float]] = []
        """(worker, action, start, end) of the last measured batch (see :func:`profile.timeline`)."""
        self.last_timeline_origin = 0.0
        """``time.perf_counter`` of the last timeline's zero (its first worker's start)."""
        self.last_timeline_plan: StagePlan | None = None
        """The plan the last timeline's batch ran on (its slots' layers; a measuring batch's plan is not the
        engine's plan after it)."""
        self.handoff: float | None = None
        """Seconds from a batch's last loss to the earliest start of the next batch's first slot, as
        the simulator charges it: the host's turn between two batches (from ``train_batch`` returning
        to its next call), the first slot's wait for the casts of its weights (one compute copy: the
        cast of update ``k - 1`` waits for step ``k``'s last read) and the upload of its weights
        (medians of recent measured batches; updated, and the prediction with it, when it moves by
        more than 5%)."""
        self._submitted: dict[int, float] = {}  # call -> when it was submitted (recent calls only)
        self._returned: float | None = None
        self._turns: deque[float] = deque(maxlen=5)
        self._first_uploads: deque[float] = deque(maxlen=5)

    def submitted(self, call: int) -> None:
        """Batch ``call`` is being dispatched now."""
        self._submitted = {c: t for c, t in self._submitted.items() if c >= call - 8}
        self._submitted[call] = now = time.perf_counter()
        if self._returned is not None:
            self._turns.append(now - self._returned)
            self._returned = None

    def returned(self) -> None:
        """``train_batch`` hands its loss back to the caller now: the host's turn starts."""
        self._returned = time.perf_counter()

    def skip_turn(self) -> None:
        """What runs until the next batch (an evaluation pass) is not the host's turn between batches."""
        self._returned = None

    def new_plan(self) -> None:
        """Another plan, another first slot: its handoff is measured anew."""
        self._first_uploads.clear()
        self.handoff = None

    def use(self, flight: Flight, plan: StagePlan) -> bool:
        """Take a recorded batch's measurements; ``True`` when the handoff moved (predict again)."""
        self.last_timeline, self.last_timeline_plan = timeline(flight), flight.schedule.plan
        self.last_timeline_origin = min(host for _, host in flight.references.values())
        period = self._period(flight.call)
        busy = busy_seconds(flight)
        self.compute_s = max(busy.values(), default=None)
        if period is not None:
            self.busy = {w: min(1.0, s / period) for w, s in busy.items()}
        moved = False
        if len(flight.first_upload) == 2 and flight.schedule.plan == plan:
            self._first_uploads.append(flight.cast_wait + WorkerDevice.elapsed(*flight.first_upload))
            if self._turns:
                handoff = median(self._turns) + median(self._first_uploads)
                # simulating takes milliseconds on the main thread before a dispatch: only for a change
                if self.handoff is None or abs(handoff - self.handoff) > 0.05 * self.handoff:
                    self.handoff, moved = handoff, True
        if self.last_timeline:
            span = max(row[3] for row in self.last_timeline) - min(row[2] for row in self.last_timeline)
            if span > 0:
                self.bubble_in_step = max(0.0, 1.0 - sum(busy.values()) / (self.num_workers * span))
                self.host_gap = None if period is None else max(0.0, 1.0 - span / period)
        return moved

    def _period(self, call: int) -> float | None:
        """The step time a batch's busy fraction is taken over: the mean interval between submissions
        over the (up to) four steps ending with the next batch's submission. One interval alone is
        noisy (a step that waited for an update is long, the one after it short); intervals long
        before the batch (profiling, another plan) say nothing about it. Without a next batch yet (a
        flush), the intervals up to the latest submission."""
        times = self._submitted
        last = call + 1 if call + 1 in times else max(times, default=call)
        first = max(min(times, default=last), last - 4)
        if last <= first:
            return None
        return (times[last] - times[first]) / (last - first)


def worker_waits(flights: Iterable[Flight]) -> dict[str, float]:
    """Per reason (:meth:`Flight.waited`), the median over these training batches of the seconds the
    workers' threads were blocked in one batch (summed over workers): which dependency holds the
    devices back when a step has idle time that its kernels do not explain."""
    batches = [f.worker_waits for f in flights if not f.evaluating]
    reasons = sorted({r for waits in batches for r in waits})
    return {r: median(waits.get(r, 0.0) for waits in batches) for r in reasons}
