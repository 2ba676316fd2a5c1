"""From a training batch to a running flight: its micro-batches and their loss weights, whether it is
guarded (:mod:`~lightning_roundpipe.engine.recovery`), its inputs and targets staged in pinned host
buffers, the flight wired into the step chain, and each worker's action list handed over."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple

from torch import Tensor

from lightning_roundpipe.engine.crew import Crew
from lightning_roundpipe.engine.planner import AutoPlanner
from lightning_roundpipe.engine.steps import StepChain
from lightning_roundpipe.runtime.callers import outside_package
from lightning_roundpipe.runtime.flight import Flight
from lightning_roundpipe.runtime.host_pool import HostPool
from lightning_roundpipe.runtime.host_store import HostStore
from lightning_roundpipe.runtime.microbatch import (
    Reduction,
    Split,
    cut,
    input_elements,
    microbatch_weights,
    split_batch,
)
from lightning_roundpipe.runtime.workers import Gate, Task
from lightning_roundpipe.schedule import Overlap, batch_schedule


@dataclass
class Batch:
    """A training batch as :meth:`~lightning_roundpipe.engine.PipelineEngine.train_batch` got it (each
    attempt splits it anew)."""

    inputs: Any
    target: Any
    loss_fn: Callable[[Any, Any], Tensor]
    reduction: Reduction
    grad_scale: float
    samples: int
    split: Split | None = None
    """How to cut it into micro-batches (``None``: along dim 0, by samples)."""
    largest: int = 0
    """Input elements of the largest micro-batch of the last attempt (what a longer batch is told by)."""

    @cached_property
    def elements(self) -> int:
        """Input elements (tokens, for a language model): with the samples, how large they are."""
        return input_elements(self.inputs)


class Attempt(NamedTuple):
    """One dispatch of a batch: its flight, the workers' tasks, and for a guarded one the step chain's
    mark from before the flight was built (:meth:`~lightning_roundpipe.engine.steps.StepChain.roll_back`)."""

    flight: Flight
    tasks: list[Task]
    mark: tuple[set[int], dict[int, Gate]] | None


class Launcher:
    """Dispatches training batches.

    Args:
        store, pool, crew, steps, planner, overlap: the engine's.
        guards: ``guards(call, microbatch_elements)``, whether a batch runs guarded.
        give_back: what becomes of a flight built but never dispatched (a failure or Ctrl-C between):
            its place in the gradient chain must not wait forever.
    """

    def __init__(
        self,
        store: HostStore,
        pool: HostPool,
        crew: Crew,
        steps: StepChain,
        planner: AutoPlanner,
        overlap: Overlap,
        guards: Callable[[int, float], bool],
        give_back: Callable[[Flight], None],
    ) -> None:
        self.store, self.pool, self.crew, self.steps, self.planner = store, pool, crew, steps, planner
        self.overlap, self.guards, self.give_back = overlap, guards, give_back
        self.asynchronous = crew.optimizer is not None
        self._warned_empty = False
        self._measured_size = 0  # samples per micro-batch of the last measuring batch

    def launch(
        self, batch: Batch, call: int, first_worker: int, retry: bool = False, skip: frozenset[int] = frozenset()
    ) -> Attempt:
        """Split, stage and dispatch ``batch`` as batch number ``call`` starting on ``first_worker``;
        ``retry``: it ran out of device memory before, and its groups ``skip`` are on the host."""
        self.pool.tick()  # buffers no batch asked for lately go back (sizes change with padded lengths)
        per_round, rounds = self.planner.counts(batch.samples)
        if self.planner.measuring:
            size = math.ceil(batch.samples / (per_round * rounds))
            if size != self._measured_size and self._measured_size:
                # the measuring batches alternate two micro-batch sizes: the other size's boundary buffers
                # only idle in the pool while this batch takes new ones (Qwen3-8B shape: 6 GiB of peak RSS)
                self.pool.trim_idle()
            self._measured_size = size
        how = f"num_microbatches={per_round} per round x num_rounds={rounds}"
        if batch.split is None:
            mb_inputs, mb_targets = split_batch(batch.inputs, batch.target, per_round * rounds, how)
        else:
            mb_inputs, mb_targets = cut(batch.split, batch.inputs, batch.target, per_round * rounds, how)
        sizes = [input_elements(x) for x in mb_inputs]
        batch.largest = max(sizes)
        weights = microbatch_weights(mb_targets, mb_inputs, batch.reduction)
        if not any(weights) and not self._warned_empty:
            self._warned_empty = True
            warnings.warn(
                "a batch has nothing to average the loss over (the reduction counted 0 items); its loss is 0"
                " and it adds no gradient. Plain PyTorch would give NaN here.",
                stacklevel=outside_package(),
            )
        guarded = retry or self.guards(call, batch.largest)
        mark = self.steps.mark() if guarded else None
        # staged first: a failure here (the host out of memory) must not leave a half-built flight behind
        staged = self.pool.stage_all([*mb_targets, *mb_inputs])
        targets, inputs = staged[: len(mb_targets)], staged[len(mb_targets) :]
        flight = None
        try:  # until the flight owns the staged parcels, a failure (or Ctrl-C) gives them back here
            if not self.asynchronous:
                self.store.sync_compute()
            schedule = batch_schedule(
                self.planner.plan, self.crew.num_workers, per_round, rounds, first_worker, self.overlap
            )
            self.steps.spare_first_slot(schedule.plan)
            record = self.planner.records(call)
            flight = self.steps.flight(
                call, schedule, targets, weights, grad_scale=batch.grad_scale, loss_fn=batch.loss_fn, record=record,
                measure_memory=record and self.planner.measuring, samples=batch.samples,
                sample_elements=batch.elements / batch.samples, microbatch_elements=sizes, guarded=guarded, skip=skip,
            )  # fmt: skip
            for m, parcel in enumerate(inputs):
                flight.put(("act", 0, m), parcel)
        except BaseException:
            for parcel in (*targets, *inputs):
                self.pool.release(parcel)  # a parcel the flight already gave back holds no buffers
            if flight is not None:  # built, never dispatched: its gates in the gradient chain would never open
                self.give_back(flight)
            raise
        tasks = self.crew.launch(flight, settle=guarded or not self.asynchronous)
        return Attempt(flight, tasks, mark)
