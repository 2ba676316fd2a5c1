"""Running a batch again when a device ran out of memory, on a plan that needs less.

Only *guarded* batches can be run again, because only for them is nothing the batch read or wrote
changed by anyone else before it is over:

- synchronous mode: every batch under ``plan="auto"`` (it settles anyway, and the weights change only
  in the optimizer step after it);
- asynchronous mode: the batches measuring the layers, the first :data:`GUARDED_BATCHES` on each plan
  (where a plan that does not fit shows itself) and any batch whose micro-batches hold more input
  elements than any before on the plan (longer sequences than it was made for). Such a batch settles
  before ``train_batch`` returns and joins its optimizer step only then: no later batch runs beside it,
  and the previous update's casts, which wait for the step's batches, cannot overwrite the weights it
  read. Other asynchronous batches overlap the next batch and those casts; out of memory there still
  stops the run, with the error saying what to change.

On a failure the flight stops alone (:meth:`~lightning_roundpipe.runtime.flight.Flight.fail`). Its
gradient writes that landed stay on the host and the next attempt skips those groups; for the others
the gradient chain is rolled back (:meth:`~lightning_roundpipe.engine.steps.StepChain.roll_back`); its
host buffers and the devices' cached blocks are given back; the planner shrinks
(:meth:`~lightning_roundpipe.engine.planner.AutoPlanner.shrink`); a warning says what changed; and the
batch runs again under its own call number (the same random streams). Weights, optimizer state and the
gradients of earlier batches are untouched, so training continues as if the smaller plan had been
chosen from the start (equal to the rounding of a different micro-batching). After
:data:`MAX_ATTEMPTS` attempts the error is raised with the plans tried.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from functools import partial

from lightning_roundpipe.engine.crew import Crew
from lightning_roundpipe.engine.drift import _size
from lightning_roundpipe.engine.launch import Attempt
from lightning_roundpipe.engine.planner import AutoPlanner
from lightning_roundpipe.engine.steps import StepChain
from lightning_roundpipe.runtime.callers import outside_package
from lightning_roundpipe.runtime.flight import Flight
from lightning_roundpipe.runtime.host_store import HostStore
from lightning_roundpipe.runtime.workers import Gate
from lightning_roundpipe.schedule.plan import StagePlan

GUARDED_BATCHES = 2
"""Asynchronous mode: the first batches on each plan are guarded (the second reaches the plan's
steady memory: the first one's allocations and the previous plan's cached blocks are behind it)."""

MAX_ATTEMPTS = 4
"""Attempts of one batch (the first and three on ever smaller plans) before the error is raised."""


class Recovery:
    """Which batches are guarded, and what follows when one of them ran out of device memory.

    Args:
        planner, steps, store, crew: the engine's.
    """

    def __init__(self, planner: AutoPlanner, steps: StepChain, store: HostStore, crew: Crew) -> None:
        self.planner, self.steps, self.store, self.crew = planner, steps, store, crew
        self.asynchronous = crew.optimizer is not None
        self.recovered = 0
        """Batches run again after running out of device memory (for monitors and tests)."""
        self._largest = 0.0  # input elements of the largest micro-batch that ran on the current plan
        self._plan_since = -1

    def give_back(self, flight: Flight) -> None:
        """A flight built but never dispatched: its gates in the gradient chain would never open."""
        if not self.asynchronous:
            self.drop(flight)
        else:
            self.crew.stop()

    def drop(self, flight: Flight) -> None:
        """Synchronous mode, after a failed batch, once every worker stopped: drop its partial gradients
        and host buffers, and be ready again (workers never write the host weights: they are intact)."""
        flight.release_all()
        self.steps.grad_chain.clear()
        self.store.clear_grads()
        self.crew.reset()

    def guards(self, call: int, microbatch_elements: float) -> bool:
        """Whether batch ``call``, whose largest micro-batch holds ``microbatch_elements`` input elements,
        runs guarded (the module docstring says which and why)."""
        if not self.planner.auto:
            return False
        if not self.asynchronous or self.planner.measuring:
            return True
        if call - self.planner.plan_since < GUARDED_BATCHES:
            return True
        return self._plan_since != self.planner.plan_since or microbatch_elements > self._largest

    def succeeded(self, microbatch_elements: float) -> None:
        """A batch ran to its end on the current plan."""
        if self._plan_since != self.planner.plan_since:
            self._plan_since, self._largest = self.planner.plan_since, 0.0
        self._largest = max(self._largest, microbatch_elements)

    def settle(
        self,
        attempt: Attempt,
        relaunch: Callable[[Flight, frozenset[int], StagePlan], Attempt],
        recover: Callable[[Flight], None] | None,
    ) -> Flight:
        """Wait for a guarded batch; each time it ran out of device memory, :meth:`recover` and
        ``relaunch(failed, skip, plan)`` it on a smaller plan. ``recover``: the engine's own handling of
        a failed batch (synchronous mode; ``None``: the asynchronous engine stops instead). Returns the
        flight that ran to its end."""
        mark = attempt.mark  # the engine before the batch's first attempt
        for tries in itertools.count(1):
            flight = attempt.flight
            self.crew.settle(attempt.tasks, None if recover is None else partial(recover, flight))
            if flight.fault is None:
                return flight
            attempt = relaunch(flight, *self.recover(flight, mark, tries, recover))
        raise AssertionError("unreachable")

    def recover(
        self,
        flight: Flight,
        mark: tuple[set[int], dict[int, Gate]] | None,
        attempt: int,
        recover: Callable[[Flight], None] | None,
    ) -> tuple[frozenset[int], StagePlan]:
        """After guarded ``flight`` (attempt number ``attempt``) stopped alone, with no thread running it
        any more: put the engine back as it was before the batch's first attempt (``mark``), keeping the
        gradient writes that landed in any attempt, and shrink
        the plan. Returns the groups the next attempt skips and the plan it runs on.

        Giving up (nothing smaller left, or :data:`MAX_ATTEMPTS`) raises the failure with the engine as
        before the batch: a landed write into a group nothing had written since the gradients were
        cleared is undone by marking the group so again. Where that is not possible (a landed write
        added to earlier batches' gradients, a group half written) ``recover`` handles the flight as any
        failed batch (synchronous mode: the step's gradients are dropped), or the engine stops."""
        error = flight.fault
        assert error is not None and mark is not None
        flight.release_all()
        landed, why_not = flight.host_writes.complete(flight.schedule.num_rounds)
        landed |= flight.host_writes.skip  # what earlier attempts put on the host
        before = self._settings()
        if why_not is None:
            self.steps.roll_back(mark, landed)
            self.crew.give_back_ahead()
            for device in self.crew.devices:
                device.release_cached()
            plan = self.planner.shrink(flight, self.store) if attempt < MAX_ATTEMPTS else None
            if plan is not None:
                return self._announce(flight, before, plan, landed)
            tried = "no smaller plan is left to try" if attempt < MAX_ATTEMPTS else f"{attempt} attempts failed"
            error.add_note(f"roundpipe ran this batch {attempt} time(s) and gave up ({tried}; the last: {before}).")
            stuck = landed - mark[0]  # added to gradients that held earlier batches' already
            self.steps.roll_back(mark, stuck)
            if not stuck:
                error.add_note(
                    "The weights, the optimizer state and the gradients of earlier batches are as before it."
                )
                raise error
            why_not = f"the gradients of groups {sorted(stuck)} were added to earlier batches' gradients"
        if recover is None:
            self.crew.stop()
        else:
            recover(flight)
        error.add_note(
            f"roundpipe could not put the engine back as before this batch: {why_not}."
            + (" The gradients of this optimizer step so far were dropped." if recover is not None else "")
        )
        raise error

    def _announce(
        self, flight: Flight, before: str, plan: StagePlan, landed: set[int]
    ) -> tuple[frozenset[int], StagePlan]:
        """Say what changed for the next attempt of ``flight``."""
        self.recovered += 1
        action, device = flight.fault_at
        stage = flight.schedule.plan.stages()[action.slot]
        warnings.warn(
            f"roundpipe: batch {flight.call} ran out of memory on {device} in stage"
            f" {stage.slot} ({stage.kind.name.lower()}, layers {stage.start}-{stage.stop - 1}) under {before}."
            f" It runs again under {self._settings(plan)}; the gradients it had not yet put on the host were"
            " dropped, and the weights, the optimizer state and earlier gradients are untouched. To start"
            " with such a plan, lower RoundPipeStrategy(gpu_memory=...) (docs/tuning.md).",
            stacklevel=outside_package(),
        )
        return frozenset(landed), plan

    def _settings(self, plan: StagePlan | None = None) -> str:
        planner = self.planner
        limit = planner.memory_limit
        memory = f", memory limit {_size(limit)}" if limit else ""
        return (
            f"plan {plan or planner.plan} with {planner.microbatches_per_round} micro-batches per round"
            f" x {planner.num_rounds} rounds{memory}"
        )
