"""The automatic planner: which plan the next batch runs, from measured layers, and when to measure again.

With ``plan="auto"`` the first ``profile_steps`` batches run one layer per stage and are recorded;
their costs (:class:`~lightning_roundpipe.runtime.profile.LayerProfile`) give the plan
(:func:`~lightning_roundpipe.schedule.choose.automatic_plan`). Every ``check_every`` batches the stage
times are measured again and compared with the plan's own first timing; two drifts in a row past
``replan_margin`` measure the layers anew, unless the host could not hold such a measuring batch. A
fixed plan is the same object with nothing to measure. The engine calls it between batches only; it
does no device work and starts no thread.
"""

from __future__ import annotations

import sys
import warnings
from statistics import median

from lightning_roundpipe.runtime.flight import Flight
from lightning_roundpipe.runtime.host_pool import HostPool
from lightning_roundpipe.runtime.host_store import HostStore
from lightning_roundpipe.runtime.profile import LayerProfile, drift, stage_times
from lightning_roundpipe.schedule.choose import PLANNERS, automatic_plan
from lightning_roundpipe.schedule.partition import LayerCosts
from lightning_roundpipe.schedule.partition import stage_times as stage_times_of_plan
from lightning_roundpipe.schedule.plan import StagePlan
from lightning_roundpipe.schedule.simulate import simulate


class AutoPlanner:
    """The current plan, the measurements it came from, and the drift checks that may replace it.

    Args:
        plan: ``"auto"``, a :class:`StagePlan` or its printed form, or ``None`` for
            :meth:`StagePlan.uniform`.
        num_layers, num_workers, microbatches_per_round, num_rounds, asynchronous: the engine's.
        pool: the host buffer pool (what a measuring batch could still take).
        profile_steps, replan_margin, check_every, planner, memory_limit: see
            :class:`~lightning_roundpipe.engine.PipelineEngine`.
    """

    def __init__(
        self,
        plan: StagePlan | str | None,
        num_layers: int,
        num_workers: int,
        microbatches_per_round: int,
        num_rounds: int,
        asynchronous: bool,
        pool: HostPool,
        profile_steps: int = 2,
        replan_margin: float = 0.25,
        check_every: int = 50,
        planner: str = "fastest",
        memory_limit: float | None = None,
    ) -> None:
        if planner not in PLANNERS:
            raise ValueError(f"planner={planner!r} is not one of {PLANNERS}")
        if replan_margin <= 0:
            raise ValueError(f"replan_margin={replan_margin} must be above 0")
        self.auto = plan == "auto"
        if isinstance(plan, str) and not self.auto:
            plan = StagePlan.parse(plan)
        self.num_layers = num_layers
        self.plan: StagePlan = (
            LayerProfile.plan(num_layers) if self.auto else plan or StagePlan.uniform(num_layers)  # type: ignore[assignment]
        )
        self.plan.check_layers(num_layers)
        self.num_workers, self.microbatches_per_round = num_workers, microbatches_per_round
        self.num_microbatches = microbatches_per_round * num_rounds
        self.asynchronous, self.pool = asynchronous, pool
        self.profile_steps, self.replan_margin, self.check_every = profile_steps, replan_margin, check_every
        self.planner, self.memory_limit = planner, memory_limit
        self.profile: LayerProfile | None = LayerProfile(num_layers) if self.auto else None
        """Samples of the batches measuring the layers, while they run (``None`` otherwise)."""
        self.layer_costs: LayerCosts | None = None
        """Measured per-layer costs (after profiling), what the plan was computed from."""
        self.predicted_bubble: float | None = None
        """The simulator's bubble ratio for the current plan and measured costs."""
        self.drift: float | None = None
        """At the last check, how far stage times moved from those first measured on the plan
        (relative to the slowest stage); ``replan_margin`` twice in a row measures the layers again."""
        self.reference: list[float] | None = None
        """The plan's stage times at its first check (what later checks compare with)."""
        self.drifted = 0
        """Checks in a row past the margin."""
        self.offset_checked = False
        """The costs were measured again for this plan's first-timing offset (it gets no further look)."""
        self.plan_since = 0
        """The first call on the current plan."""
        self._record_next = False
        self._boundary_bytes = 0  # of the last recorded batch: the largest activation between two layers
        self._warned_measuring = False

    @property
    def measuring(self) -> bool:
        """Whether the batches run now measure the layers (one layer per stage)."""
        return self.profile is not None

    # ------------------------------------------------------------------ what to record
    def measure_next(self) -> None:
        """Record the next batch's compute times (for the engine's measured busy time and drift checks)."""
        self._record_next = True

    def records(self, call: int) -> bool:
        """Whether batch ``call`` is recorded; a :meth:`measure_next` request is used up by it."""
        record = self.profile is not None or self._record_next
        record = record or (self.auto and self.check_every > 0 and call % self.check_every == 0)
        self._record_next = False
        return record

    # ------------------------------------------------------------------ using a recorded batch
    def use(self, flight: Flight, store: HostStore) -> StagePlan | None:
        """Learn from a recorded batch whose work is done; returns the plan to switch to, if any."""
        self._boundary_bytes = flight.boundary_bytes or self._boundary_bytes
        if self.profile is not None and flight.schedule.plan == LayerProfile.plan(self.num_layers):
            self.profile.add(flight)
            if self.profile.batches < self.profile_steps:
                return None
            self.layer_costs = self.profile.costs(store)
            self.profile = None
            return automatic_plan(
                self.layer_costs, self.num_workers, self.num_microbatches, self.memory_limit, self.planner,
                self.asynchronous,
            ).plan  # fmt: skip
        if self._is_check(flight):
            self._check_drift(stage_times(flight), flight.call)
        return None

    def set_plan(self, plan: StagePlan, call: int) -> None:
        """Run ``plan`` from batch ``call`` on; its drift checks start afresh."""
        self.plan = plan
        self.reference, self.drifted, self.plan_since, self.drift = None, 0, call, None

    def replan(self) -> None:
        """Measure the layers again (one layer per stage) and plan from the new costs. The plan that
        follows gets its own second look if its first timing is off these costs."""
        self.profile = LayerProfile(self.num_layers)
        self.plan = LayerProfile.plan(self.num_layers)
        self.drifted, self.reference, self.drift, self.offset_checked = 0, None, None, False

    def predict(self, handoff: float | None) -> None:
        """The simulator's bubble ratio for the current plan, measured layer costs and ``handoff``."""
        if self.layer_costs is not None:
            self.predicted_bubble = simulate(
                "roundpipe-async" if self.asynchronous else "roundpipe-sync",
                self.layer_costs, self.num_workers, self.num_microbatches, plan=self.plan,
                handoff=handoff or 0.0,
            ).bubble_ratio  # fmt: skip

    # ------------------------------------------------------------------ drift
    def _is_check(self, flight: Flight) -> bool:
        """A batch recorded for the drift check (every ``check_every``), on the current automatic plan.
        Batches recorded for a monitor do not count: drift is judged at the engine's own cadence."""
        return (
            self.layer_costs is not None
            and self.auto
            and self.check_every > 0
            and flight.call % self.check_every == 0
            and flight.call >= self.plan_since
            and flight.schedule.plan == self.plan
        )

    def _check_drift(self, times: dict[int, list[float]], call: int) -> None:
        """Stage times against the plan's own first timing, not against the sums of per-layer costs: a
        stage of several layers runs at its own pace (launch gaps, waits for chunked uploads), and an
        offset from the sums that every measurement shows would measure, partition, land on the same
        plan and measure again forever (seen on 2 H200s). An offset at the plan's first timing gets one
        more measurement (a slowdown right after profiling, one-offs in the first profile); what
        remains after it is the plan's pace."""
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

    def _measuring_fits(self) -> bool:
        """Whether the host can hold a batch under the measuring plan. One layer per stage keeps every
        layer's input on the host until its backward, where a plan keeps only its backward stages'
        inputs: at long sequences that can be twice the host memory of a planned batch (by arithmetic on
        one H200 at 327,680 tokens: 57 boundaries of 1.25 GiB against the plan's 29). A run that fits its
        plan must not die of a re-measurement hours in; it keeps its plan instead, and says so once.

        The estimate takes every boundary as wide as the widest the last recorded batch passed (a
        decoder's are all one hidden state wide), two rounds of micro-batches alive at once (workers
        overlap a round's backward with the next one's forward), and, in asynchronous mode, two batches."""
        measuring = len(LayerProfile.plan(self.num_layers).saved_boundaries())
        alive = min(self.num_microbatches, 2 * self.microbatches_per_round) * (2 if self.asynchronous else 1)
        need = (measuring - len(self.plan.saved_boundaries())) * alive * self._boundary_bytes
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
                stacklevel=_caller_outside_package(),
            )
        return False


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _caller_outside_package() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside this package (the user's
    code or Lightning's), however deep inside the engine it is raised."""
    frame, level = sys._getframe(1), 1  # the function that warns
    while frame is not None and frame.f_globals.get("__name__", "").startswith("lightning_roundpipe"):
        frame, level = frame.f_back, level + 1
    return level
