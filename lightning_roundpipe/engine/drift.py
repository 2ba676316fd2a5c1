"""Drift checks, the part of :class:`~lightning_roundpipe.engine.planner.AutoPlanner` that decides when the layers
are measured again: every ``check_every`` batches the stage times are compared with the plan's own first timing
(scaled to the planned micro-batch size: lengths that vary are no drift); two drifts in a row past
``replan_margin`` measure again, unless the host could not hold such a measuring batch."""

from __future__ import annotations

import warnings
from statistics import median
from typing import TYPE_CHECKING

from lightning_roundpipe.runtime.callers import outside_package
from lightning_roundpipe.runtime.flight import Flight
from lightning_roundpipe.runtime.profile import LayerProfile, drift
from lightning_roundpipe.schedule.partition import stage_times as stage_times_of_plan

if TYPE_CHECKING:
    from lightning_roundpipe.engine.planner import AutoPlanner


class DriftChecks:
    """Mixed into :class:`~lightning_roundpipe.engine.planner.AutoPlanner`, whose state it reads and sets
    (``reference``, ``drifted``, ``drift``, ``offset_checked``); one job, kept apart from planning."""

    def _is_check(self: AutoPlanner, flight: Flight) -> bool:
        """A batch recorded for the drift check (every ``check_every``, not a monitor's), on the plan."""
        schedule = flight.schedule
        return (
            self.layer_costs is not None and self.auto and self.check_every > 0
            and flight.call % self.check_every == 0 and flight.call >= self.plan_since and schedule.plan == self.plan
            and (schedule.microbatches_per_round, schedule.num_rounds) == (self.microbatches_per_round, self.num_rounds)
        )  # fmt: skip

    def _check_drift(self: AutoPlanner, times: dict[int, list[float]], call: int) -> None:
        """Stage times against the plan's own first timing, not the sums of per-layer costs (a stage runs
        at its own pace; an offset every measurement shows would re-measure forever, seen on 2 H200s).
        An offset at the first timing gets one more measurement; what remains is the plan's pace."""
        if call <= self.plan_since:  # not the plan's first batch (allocations, first casts; or a resume's)
            return
        if self.reference is None:
            slots = range(self.plan.num_slots)
            if not all(times.get(slot) for slot in slots):
                return
            assert self.layer_costs is not None
            if not self.offset_checked and drift(times, stage_times_of_plan(self.layer_costs, self.plan)) > (
                self.replan_margin
            ):
                fits = self._measuring_fits()
                if fits:
                    self.replan()
                self.offset_checked = True  # the plan from this measurement gets no further look
                if fits:
                    return
            self.reference = [median(times[slot]) for slot in slots]
            return
        self.drift = drift(times, self.reference)
        self.drifted = self.drifted + 1 if self.drift > self.replan_margin else 0
        if self.drifted >= 2:
            if self._measuring_fits():
                self.replan()
            else:
                self.drifted = 0

    def _measuring_fits(self: AutoPlanner) -> bool:
        """Whether the host can hold a measuring batch (every layer's input kept for backward): a run that
        fits its plan must not die of a re-measurement hours in; it keeps its plan, and says so once.
        Boundaries as wide as the last recorded batch's widest, two rounds alive (one micro-batch each
        when measuring)."""
        measuring = len(LayerProfile.plan(self.num_layers).saved_boundaries()) * min(self.num_microbatches, 2)
        planned = len(self.plan.saved_boundaries()) * min(self.num_microbatches, 2 * self.microbatches_per_round)
        need = max(0, measuring - planned) * self._boundary_bytes
        left = self.pool.available() - self.pool.reserve
        if need <= left:
            return True
        if not self._warned_measuring:
            self._warned_measuring = True
            warnings.warn(
                f"roundpipe: the stage times moved away from the plan's, but measuring the layers again (one"
                f" layer per stage, every layer's input kept on the host for backward) would take about"
                f" {_size(need)} more host memory than this plan, and {_size(max(0, left))} are free beyond"
                " the pool's reserve: the current plan stays. Pass an explicit plan to RoundPipeStrategy to"
                " pin one (docs/tuning.md).",
                stacklevel=outside_package(),
            )
        return False


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
