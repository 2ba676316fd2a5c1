"""The automatic planner: the plan and micro-batch count the next batch runs, and when to measure again.

With ``plan="auto"`` the first ``profile_steps`` batches run one layer per stage and are recorded;
their costs (:class:`~lightning_roundpipe.runtime.profile.LayerProfile`) give the plan
(:func:`~lightning_roundpipe.schedule.choose.automatic_plan`). Unless the micro-batch count was given,
the second of those batches runs twice as many, smaller micro-batches, and the count is chosen with
the plan: the fastest simulated pair under the memory limit
(:func:`~lightning_roundpipe.schedule.choose.plan_with_microbatches`). A fixed plan takes
:func:`default_microbatches`. Any batch smaller than the count runs as fewer micro-batches.

Every ``check_every`` batches the stage times are measured again and compared with the plan's own
first timing; two drifts in a row past ``replan_margin`` measure the layers anew, unless the host could
not hold such a measuring batch. A fixed plan is the same object with nothing to measure. The engine
calls it between batches only; it does no device work and starts no thread.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import replace

from lightning_roundpipe.engine.drift import DriftChecks
from lightning_roundpipe.engine.shapes import BatchShapes, MicrobatchSizes
from lightning_roundpipe.runtime.callers import outside_package
from lightning_roundpipe.runtime.compiles import compile_mark
from lightning_roundpipe.runtime.flight import Flight
from lightning_roundpipe.runtime.host_pool import HostPool
from lightning_roundpipe.runtime.host_store import HostStore
from lightning_roundpipe.runtime.profile import LayerProfile, TransferRate, microbatch_sizes, stage_times_at
from lightning_roundpipe.schedule.choose import PLANNERS, automatic_plan, microbatch_candidates, plan_with_microbatches
from lightning_roundpipe.schedule.partition import Infeasible, LayerCosts, stage_memory
from lightning_roundpipe.schedule.plan import StagePlan
from lightning_roundpipe.schedule.simulate import simulate


def default_microbatches(num_workers: int) -> int:
    """Micro-batches per round when none are given: twice the workers, and at least 4. More than the
    workers keeps every device busy through a round (the bubble is ``N(N-1)`` slot times per
    ``M * S + N(N-1)``); 4 on one GPU measured fastest for the Qwen3-1.7B shape at 32 x 2048 tokens on
    an H200 (1.08x 2 micro-batches, 1.05x 8, at 24 GiB)."""
    return max(4, 2 * num_workers)


class AutoPlanner(DriftChecks, MicrobatchSizes):
    """The current plan, the measurements it came from, and the drift checks that may replace it.

    Args:
        plan: ``"auto"``, a :class:`StagePlan` or its printed form, or ``None`` for
            :meth:`StagePlan.uniform`.
        num_layers, num_workers, num_rounds, asynchronous: the engine's.
        microbatches_per_round: micro-batches per round, honoured wherever a batch is large enough;
            ``None``: chosen (:func:`default_microbatches`, then with the plan under ``"auto"``).
        pool: the host buffer pool (what a measuring batch could still take).
        profile_steps, replan_margin, check_every, planner, memory_limit: see
            :class:`~lightning_roundpipe.engine.PipelineEngine`.
    """

    def __init__(
        self,
        plan: StagePlan | str | None,
        num_layers: int,
        num_workers: int,
        microbatches_per_round: int | None,
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
        self.num_workers, self.num_rounds = num_workers, num_rounds
        self.explicit_microbatches = microbatches_per_round is not None
        self.microbatches_per_round = microbatches_per_round or default_microbatches(num_workers)
        """Micro-batches per round of a batch large enough: given, or chosen (with the plan under ``"auto"``)."""
        self.asynchronous, self.pool = asynchronous, pool
        self.profile_steps, self.replan_margin, self.check_every = profile_steps, replan_margin, check_every
        self.planner, self.memory_limit = planner, memory_limit
        self.profile: LayerProfile | None = LayerProfile(num_layers) if self.auto else None
        """Samples of the batches measuring the layers, while they run (``None`` otherwise)."""
        self.fitted: LayerProfile | None = None  # the last completed measurement (what `shrink` plans from again)
        self.layer_costs: LayerCosts | None = None  # measured per-layer costs, what the plan was computed from
        self.predicted_bubble: float | None = None  # the simulator's bubble ratio for the plan and costs
        self.drift: float | None = None  # at the last check, how far stage times moved from the plan's first
        self.reference: list[float] | None = None  # the plan's stage times at its first check (later ones compare)
        self.drifted = 0  # checks in a row past the margin (two measure the layers again)
        self.offset_checked = False
        """The costs were measured again for this plan's first-timing offset (it gets no further look)."""
        self.plan_since = 0
        """The first call on the current plan."""
        self._record_next = False
        self._boundary_bytes = 0  # of the last recorded batch: the largest activation between two layers
        self._warned_measuring = False
        self._warned_lowered = False
        self._measuring_dispatched = 0  # measuring batches handed to the workers (the odd ones run smaller)
        self._compiled_batches = 0  # measuring batches left out because torch.compile compiled during them
        self.batch_samples = 0  # the largest batch measured (what the micro-batch count is chosen for)
        self._reset_sizes()
        self.planned_elements = 0.0  # input elements of the micro-batch the plan's times are for
        self.memory_elements = 0.0  # input elements of the largest micro-batch the plan's memory is for
        self.shapes = BatchShapes()  # recent batches' micro-batch sizes at any count (a padded batch cut by tokens)
        self.transfers = TransferRate()
        self.candidate_periods: dict[int, float] = {}
        """When the micro-batch count was chosen: each feasible count's simulated seconds per batch."""

    @property
    def num_microbatches(self) -> int:
        return self.microbatches_per_round * self.num_rounds

    @property
    def chooses_microbatches(self) -> bool:
        """Whether the micro-batch count is chosen with the plan (``"auto"``, none given, one round)."""
        return self.auto and not self.explicit_microbatches and self.num_rounds == 1

    def counts(self, samples: int) -> tuple[int, int]:
        """Micro-batches per round and rounds for a batch of ``samples``. A smaller batch runs as fewer
        micro-batches (same loss and gradients); a count the user gave is lowered so, with one warning.
        The odd measuring batches, when the count is chosen, run twice the count, one micro-batch per
        round: every layer's input waits on the host for backward, two micro-batches' worth at a time."""
        if samples < 1:
            raise ValueError("a batch of 0 samples has nothing to train on; skip it before the model call")
        per_round, rounds = self.microbatches_per_round, self.num_rounds
        if self.profile is not None and self.chooses_microbatches and self._measuring_dispatched % 2 == 1:
            per_round *= 2
        per_round = min(per_round, samples)
        rounds = max(1, min(rounds, samples // per_round))
        if self.explicit_microbatches and per_round * rounds < self.num_microbatches and not self._warned_lowered:
            self._warned_lowered = True
            warnings.warn(
                f"roundpipe: a batch of {samples} samples cannot be cut into num_microbatches="
                f"{self.microbatches_per_round} per round x num_rounds={self.num_rounds}; it runs as"
                f" {per_round} x {rounds} micro-batches (the same loss and gradients, only the work is spread"
                " differently). This warning is not repeated.",
                stacklevel=outside_package(),
            )
        if self.profile is not None:
            return 1, per_round * rounds
        return per_round, rounds

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
        if self.profile is not None:
            self._measuring_dispatched += 1
        return record

    # ------------------------------------------------------------------ using a recorded batch
    def use(self, flight: Flight, store: HostStore) -> StagePlan | None:
        """Learn from a recorded batch whose work is done; returns the plan to switch to, if any."""
        self._boundary_bytes = flight.boundary_bytes or self._boundary_bytes
        self.transfers.measure(flight)
        if self.profile is not None and flight.schedule.plan == LayerProfile.plan(self.num_layers):
            if compile_mark() != flight.compile_mark and self._compiled_batches < max(2, self.profile_steps):
                self._compiled_batches += 1  # its times hold a compile (a first, or a first dynamic size)
                return None
            self.profile.add(flight)
            self.batch_samples = max(self.batch_samples, flight.samples)
            self._record_sizes(microbatch_sizes(flight), flight.samples, flight.sample_elements)
            if self.profile.batches < self.profile_steps:
                return None
            return self._plan_from(self.profile, store)
        if self._is_check(flight) and compile_mark() == flight.compile_mark:  # a compile is no drift
            sizes = (self.fitted, self.layer_costs, self.planned_elements)
            self._check_drift(stage_times_at(flight, store, self.plan, *sizes), flight.call)  # lengths are no drift
        return None

    def _plan_from(self, profile: LayerProfile, store: HostStore) -> StagePlan:
        """The plan (and, when chosen, the micro-batch count) from the measured layers."""
        self.profile, self.fitted = None, profile
        return self._choose(profile, store, self.batch_samples or self.num_microbatches, self.memory_limit)

    def _choose(self, profile: LayerProfile, store: HostStore, samples: int, limit: float | None) -> StagePlan:
        """The plan (and, when chosen, the micro-batch count) for batches of ``samples`` under ``limit``: times
        for micro-batches of the measured batches' mean size, memory for the widest sample seen in each (a
        padded batch of variable lengths: every micro-batch within the plan's memory however its rows fall).
        Raises ``Infeasible`` when no plan fits."""
        if self.chooses_microbatches:
            # no micro-batch smaller than measured (nor than the full batch's twice-halved count: a short
            # batch measured must not open hundreds of candidates to simulate on the main thread)
            smallest = max(min(profile.sizes) / self.mean_elements, samples / (4 * self.microbatches_per_round))
            candidates = microbatch_candidates(samples, self.num_workers, smallest)
            trip = self.transfers.round_trip
            count, chosen, self.candidate_periods = plan_with_microbatches(
                lambda size: self._costs_at(profile, store, size, samples), samples, self.num_workers, candidates,
                limit, self.planner, self.asynchronous, lambda size: trip(size * self.mean_elements),
            )  # fmt: skip
            self.microbatches_per_round = count
            self._planned(profile, store, samples / count, samples)
            return chosen.plan
        size = samples / max(1, min(samples, self.num_microbatches))
        plan = automatic_plan(
            self._costs_at(profile, store, size, samples), self.num_workers, self.num_microbatches, limit, self.planner,
            self.asynchronous,
        ).plan  # fmt: skip
        self._planned(profile, store, size, samples)
        return plan

    def _planned(self, profile: LayerProfile, store: HostStore, samples: float, batch: float) -> None:
        """The chosen plan's costs, for micro-batches of ``samples`` of batches of ``batch``."""
        self.layer_costs = self._costs_at(profile, store, samples, batch)
        self.planned_elements, self.memory_elements = self.sizes_for(samples, batch)

    def _costs_at(self, profile: LayerProfile, store: HostStore, samples: float, batch: float) -> LayerCosts:
        """Costs of a micro-batch of ``samples``: times at the mean elements, memory at the largest (the first
        micro-batch's one-off allocations left out beyond the sizes measured)."""
        largest, (mean, widest) = max(profile.sizes), self.sizes_for(samples, batch)
        times = profile.costs(store, mean, mean <= 1.01 * largest)
        if widest <= mean:
            return times
        memory = profile.costs(store, widest, widest <= 1.01 * largest)
        return replace(
            times, forward_activations=memory.forward_activations, backward_activations=memory.backward_activations,
            backward_transients=memory.backward_transients,
        )  # fmt: skip

    # ------------------------------------------------------------------ out of device memory
    def shrink(self, flight: Flight, store: HostStore) -> StagePlan | None:
        """After ``flight`` (a guarded batch) ran out of device memory: the plan to run it again on, with
        the micro-batch count and memory limit changed to need less; ``None`` when nothing smaller is
        left. Measured memory first: the limit becomes 80% of what the failing stage was predicted to
        need for the failed batch's largest micro-batch, and the plan and count are chosen again under it
        (for its widest sample, if wider than any before). Without that (a batch that was measuring the
        layers) or when no plan fits it: twice the micro-batches, or where each holds one sample already,
        the failing stage cut in two."""
        samples = max(self.batch_samples, flight.samples)
        if self.fitted is not None and self.profile is None:
            self.row_elements = max(self.row_elements, flight.sample_elements)
            size = max(microbatch_sizes(flight))
            stage = flight.schedule.plan.stages()[flight.fault_at[0].slot]
            need = stage_memory(self.fitted.costs(store, size, size <= 1.01 * max(self.fitted.sizes)), stage)
            limit = 0.8 * min(need, self.memory_limit or need)
            if need > 0 and (plan := self.plan_for_memory(store, limit, samples)) is not None:
                return plan
        if (total := flight.schedule.microbatches_per_round * flight.schedule.num_rounds) < flight.samples:
            self.microbatches_per_round = max(self.microbatches_per_round, 2 * total // self.num_rounds)
            return self.plan
        stage = flight.schedule.plan.stages()[flight.fault_at[0].slot]  # one sample per micro-batch already:
        return flight.schedule.plan.split(stage.slot) if len(stage.layers) > 1 and self.profile is None else None

    def plan_for_memory(self, store: HostStore, limit: float, samples: int = 0) -> StagePlan | None:
        """The plan (and count) chosen again from the last measurement under ``limit``, which becomes the
        memory limit; ``None`` without a measurement, or when no plan fits."""
        if self.fitted is None or self.profile is not None:
            return None
        samples = samples or self.batch_samples or self.num_microbatches
        with contextlib.suppress(Infeasible):
            plan = self._choose(self.fitted, store, samples, limit)
            self.memory_limit = limit
            return plan
        return None

    def widen(self, store: HostStore, samples: int, row_elements: float, noted: bool = False) -> StagePlan | None:
        """Before a batch with more samples, a wider sample, or (``noted``: its micro-batches' sizes at any count
        are the newest in :attr:`shapes`) a larger micro-batch than any the plan was made for: the plan (and
        count) for it from the measured costs, without measuring again, when it differs from the running one;
        ``None`` to stay (also when nothing fits: the batch runs guarded, :meth:`shrink` follows)."""
        if not self.auto or self.fitted is None or self.profile is not None:
            return None
        # with the split's sizes, memory follows them (a wider row alone says nothing more)
        larger = noted and self.shapes.newest_largest(self.num_microbatches) > self.memory_elements
        wider = row_elements > self.row_elements and not noted
        if samples <= self.batch_samples and not wider and (not larger or self._still_fits(store)):
            return None  # nothing larger, or a larger micro-batch the running plan holds: no change of pace
        running = (self.plan, self.microbatches_per_round, self.batch_samples, self.row_elements)
        costs = (self.layer_costs, self.planned_elements, self.memory_elements)
        self.batch_samples, self.row_elements = max(self.batch_samples, samples), max(self.row_elements, row_elements)
        try:
            plan = self._choose(self.fitted, store, self.batch_samples, self.memory_limit)
        except Infeasible:
            self.plan, self.microbatches_per_round, self.batch_samples, self.row_elements = running
            self.layer_costs, self.planned_elements, self.memory_elements = costs
            return None
        if (plan, self.microbatches_per_round) != running[:2]:
            return plan
        self.layer_costs, self.planned_elements = costs[:2]  # the same plan: its times (and drift reference) stay
        return None

    def _still_fits(self, store: HostStore) -> bool:
        """Whether the running plan's stages hold the largest micro-batch the split's sizes now say (which then
        becomes what its memory is for)."""
        per = self.batch_samples / max(1, self.num_microbatches)
        costs, largest = self._costs_at(self.fitted, store, per, self.batch_samples), self.sizes_for(per)[1]
        if self.memory_limit is not None and any(
            stage_memory(costs, s) > self.memory_limit for s in self.plan.stages()
        ):
            return False
        self.memory_elements = largest
        return True

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
        self._measuring_dispatched = self.batch_samples = self._compiled_batches = 0
        self._reset_sizes()

    def predict(self, handoff: float | None) -> None:
        """The simulator's bubble ratio for the current plan, measured layer costs and ``handoff``."""
        if self.layer_costs is not None:
            self.predicted_bubble = simulate(
                "roundpipe-async" if self.asynchronous else "roundpipe-sync",
                self.layer_costs, self.num_workers, self.num_microbatches, plan=self.plan,
                handoff=handoff or 0.0,
            ).bubble_ratio  # fmt: skip


@contextlib.contextmanager
def unchanged(planner: AutoPlanner) -> Iterator[None]:
    """Plans tried inside (:meth:`AutoPlanner.plan_for_memory`) leave ``planner`` as it was: its plan and count, their
    simulated periods and costs, and its memory limit. Choosing again under the old limit is no restore: the shapes
    and transfer rates it chooses from move with every batch."""
    restore = snapshot(planner)
    try:
        yield
    finally:
        restore()


def snapshot(planner: AutoPlanner) -> Callable[[], None]:
    """What :func:`unchanged` restores, as a call: for a caller that keeps some of the plans it tries."""
    names = ("plan", "microbatches_per_round", "candidate_periods", "memory_limit", "layer_costs")
    saved = {name: getattr(planner, name) for name in (*names, "planned_elements", "memory_elements")}

    def restore() -> None:
        for name, value in saved.items():
            setattr(planner, name, value)

    return restore
