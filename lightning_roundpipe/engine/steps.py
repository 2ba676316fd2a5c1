"""Optimizer steps as the engine orders them: which batches form a step, the per-group order of
gradient writes and updates, the casts of updates into the compute copies, and the hand-off of each
step to the optimizer thread (see :mod:`~lightning_roundpipe.runtime.optimizer_worker` for the five
edges). Synchronous mode uses only the gradient chain; the rest is the asynchronous optimizer's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from lightning_roundpipe.runtime.flight import Flight
from lightning_roundpipe.runtime.host_pool import HostPool, Parcel
from lightning_roundpipe.runtime.host_store import HostStore
from lightning_roundpipe.runtime.one_pass import OnePass
from lightning_roundpipe.runtime.optimizer_worker import OptimizerWorker
from lightning_roundpipe.runtime.updates import StepWindow, UpdateJob, UpdateSpec
from lightning_roundpipe.runtime.workers import Gate, PipelineAborted
from lightning_roundpipe.schedule.dispatch import Schedule
from lightning_roundpipe.schedule.plan import StagePlan

DOUBLE_BUFFERS = ("none", "first", "all")


def double_buffering(value: bool | str) -> str:
    """``double_buffer`` as one of :data:`DOUBLE_BUFFERS` (``True`` is ``"all"``, ``False`` ``"none"``)."""
    if value is True or value is False:
        return "all" if value else "none"
    if value not in DOUBLE_BUFFERS:
        raise ValueError(f"double_buffer={value!r} is not one of {DOUBLE_BUFFERS} (or True/False)")
    return str(value)


class StepChain:
    """The current optimizer step, its window of batches, and the gates that order groups across steps.

    Args:
        store, pool: the engine's host store and buffer pool (spare compute copies are pinned there).
        abort: the crew's abort: every gate here opens with it.
        optimizer: the optimizer thread (asynchronous mode), else ``None``.
        fail: stops the engine and raises its error (when a wait here was aborted).
        plan: the first batch's plan (with ``double_buffer="first"``, its first slot's groups get spares).
        double_buffer: one of :data:`DOUBLE_BUFFERS`: spare compute copies of every trainable group, of
            the plan's first slot's (grown at a step's start when the plan changes), or none.
        held: groups whose states the device holds (their two copies there are what double buffering gives).
        one_pass: with ``"all"``, build the one-pass kernel (:mod:`~lightning_roundpipe.runtime.one_pass`) now.
    """

    def __init__(
        self,
        store: HostStore,
        pool: HostPool,
        abort: threading.Event,
        optimizer: OptimizerWorker | None,
        fail: Callable[[], None],
        plan: StagePlan,
        double_buffer: str = "none",
        held: frozenset[int] = frozenset(),
        one_pass: bool = True,
    ) -> None:
        self.store, self.pool, self.abort, self.optimizer, self.fail = store, pool, abort, optimizer, fail
        self.double_buffer, self.held = double_buffer, held
        self.step = 0
        """Optimizer step the next batch belongs to (asynchronous mode)."""
        self.trainable = tuple(g.index for g in store.groups if g.trainable)
        self.grad_chain: dict[int, Gate] = {}
        """Per trainable group, the gate its next gradient write waits for (the previous writer's)."""
        self.cast_done: dict[int, dict[int, Gate]] = {}
        """Per step, per group: open once that step's update reached the compute copy."""
        self.windows: dict[int, StepWindow] = {0: StepWindow(abort)}
        self._job_gates: list[Gate] = []
        self._slot_groups: dict[StagePlan, dict[int, tuple[int, ...]]] = {}
        if double_buffer == "all":
            spared = [g for g in self.trainable if g not in held]
            store.add_spares(spared, prepare=pool.register)
            if optimizer is not None and one_pass and spared:  # AdamW's math and cast in one pass, before any batch
                OnePass.compile(self._cast_dtypes())
        elif double_buffer == "first":  # no batch yet: any time is right
            store.add_spares([g for g in self.slot_groups(plan)[0] if g not in held], prepare=pool.register)

    @property
    def asynchronous(self) -> bool:
        return self.optimizer is not None

    def slot_groups(self, plan: StagePlan) -> dict[int, tuple[int, ...]]:
        """Per slot of ``plan``, the trainable groups it reads and writes gradients to."""
        if plan not in self._slot_groups:
            self._slot_groups[plan] = {
                stage.slot: tuple(g for g in self.store.groups_of(stage.layers) if self.store.groups[g].trainable)
                for stage in plan.stages()
            }
        return self._slot_groups[plan]

    # ------------------------------------------------------------------ batches joining a step
    def between_steps(self) -> bool:
        """Whether no batch has joined the current optimizer step yet (its gradients hold no batch's)."""
        if self.asynchronous:
            return not self.windows[self.step].flights
        return self.store.fresh_grads == set(self.trainable)

    def check_open(self) -> None:
        """Refuse a batch after the one promised to be its step's last."""
        if self.asynchronous and self.windows[self.step].closed.is_set():
            raise RuntimeError(
                f"a batch arrived for optimizer step {self.step} after the batch promised to be its last"
                " (train_batch(last_of_step=True)); call submit_step first, or pass last_of_step only on a"
                " step's last batch"
            )

    def flight(
        self, call: int, schedule: Schedule, targets: list[Parcel], weights: list[float], **kwargs: Any
    ) -> Flight:
        """A training batch's flight, wired into the gradient chain of the current step."""
        return Flight(
            call, schedule, targets, weights, abort=self.abort, pool=self.pool, grad_chain=self.grad_chain,
            groups_of_slot=self.slot_groups(schedule.plan).__getitem__, fresh_grads=self.store.fresh_grads,
            upload_waits=self.cast_done.get(self.step - 2), step=self.step, **kwargs,
        )  # fmt: skip

    def joined(self, flight: Flight, last_of_step: bool) -> None:
        """Asynchronous mode: ``flight`` was dispatched as one of this step's batches."""
        window = self.windows[self.step]
        window.flights.append(flight)
        if last_of_step:
            window.closed.set()  # after the append: the optimizer thread reads the complete list

    def spare_first_slot(self, plan: StagePlan) -> None:
        """Give the groups ``plan``'s first slot reads a spare copy, before a step's first batch.

        Only there: no batch of this step has chosen a copy yet. Update ``step - 1``'s cast decides
        after its math whether the group has a spare; deciding "yes" it writes the copy the step after
        next reads at once, which mid-step would be the copy this step's earlier batches still upload
        (a plan change in the middle of an accumulated step waits for the next step). A new spare
        starts as a copy of the compute copy, which must hold updates ``0..step-2``: wait for update
        ``step - 2``'s cast (it waits for the previous step's last upload of the group, so no earlier
        batch reads the group any more). It is pinned before it is published.
        """
        if self.double_buffer != "first" or self.windows[self.step].flights:
            return
        new = [g for g in self.slot_groups(plan)[0] if self.store.groups[g].spare is None and g not in self.held]
        if not new:
            return
        pending = self.cast_done.get(self.step - 2, {})
        try:
            for g in new:
                if g in pending:
                    pending[g].wait()
        except PipelineAborted:
            self.fail()
        self.store.add_spares(new, prepare=self.pool.register)

    # ------------------------------------------------------------------ the hand-off
    def cast_previous_here(self) -> None:
        """The blocking variant (``consistency="barrier"``, after a drain): cast the previous update into
        every group on the calling thread."""
        for g, gate in self.cast_done.get(self.step - 1, {}).items():
            self.store.refresh_group(g, self.step + 1)
            gate.set()

    def submit(self, spec: UpdateSpec, cast: bool = True) -> None:
        """Hand the current step's update to the optimizer thread and start the next step; ``cast=False``
        leaves the casts to :meth:`cast_previous_here`. A step without batches updates nothing."""
        assert self.optimizer is not None
        k = self.step
        window = self.windows[k]
        if not window.flights:
            return
        grads_complete = {g: self.grad_chain[g] for g in self.trainable if g in self.grad_chain}
        order = self._update_order(grads_complete)
        consumed = {g: self._job_gate() for g in order}
        cast_done = {g: self._job_gate() for g in order}
        self.grad_chain.update(consumed)  # the next step's first gradient writes wait for these
        self.cast_done[k] = cast_done
        self.cast_done.pop(k - 3, None)
        next_window = StepWindow(self.abort)
        self.windows[k + 1] = next_window
        self.windows.pop(k - 2, None)
        window.closed.set()
        self.store.fresh_grads = set(self.trainable)
        one_pass = cast and self.double_buffer == "all" and OnePass.ready(spec.optimizer, self._cast_dtypes())
        self.optimizer.submit(
            UpdateJob(k, spec, order, grads_complete, consumed, cast_done, next_window, cast, window, one_pass)
        )
        self.step += 1

    def _cast_dtypes(self) -> set[torch.dtype]:
        """The compute copies' dtypes of the fp32 masters (what the one-pass kernel casts into)."""
        return {g.compute.dtype for g in self.store.groups if g.trainable and g.data.dtype == torch.float32}

    def pending_casts(self) -> dict[int, Gate]:
        """The groups whose compute copy still waits for the last submitted update."""
        return self.cast_done.get(self.step - 1, {})

    def settle_early_casts(self) -> None:
        """After a batch announced as its step's last and before :meth:`submit` (an exception
        checkpoint, say), the previous update's casts are already under way: let them land, so that
        nothing reads or sets aside a half-written copy. The copies then hold that update, one update
        ahead of what a step boundary would save (a run resumed from here computes its first step on
        the newest weights)."""
        if self.asynchronous and self.windows[self.step].closed.is_set():
            try:
                for gate in self.pending_casts().values():
                    gate.wait()
            except PipelineAborted:
                self.fail()

    def resume(self, step: int, compute: dict[int, Any] | None) -> None:
        """Continue at ``step``; with the compute copies a checkpoint saved one update behind the masters,
        queue a cast-only job so that update reaches them after the first resumed batch uploaded each
        group, exactly as it would have."""
        self.step = step
        self.windows = {step: StepWindow(self.abort)}
        if compute is None:
            return
        assert self.optimizer is not None
        for g, tensor in compute.items():
            self.store.reads(g, step).copy_(tensor)
        order = self._update_order(self.trainable)
        cast_done = {g: self._job_gate() for g in order}
        self.cast_done = {step - 1: cast_done}
        self.optimizer.submit(UpdateJob(step - 1, None, order, {}, {}, cast_done, self.windows[step]))

    # ------------------------------------------------------------------ a batch run again
    def mark(self) -> tuple[set[int], dict[int, Gate]]:
        """What building a flight changes here (the groups whose next write overwrites, the gradient
        chain), taken before a guarded batch's flight is built: :meth:`roll_back` returns to it."""
        return set(self.store.fresh_grads), dict(self.grad_chain)

    def roll_back(self, mark: tuple[set[int], dict[int, Gate]], landed: set[int]) -> None:
        """Take a failed batch out of the chain. The groups in ``landed`` hold its gradient now (the next
        attempt skips them); the others are as before it, so whatever the failed attempt half wrote into
        a group it was the first to write is overwritten again."""
        fresh, chain = mark
        self.store.fresh_grads = fresh - landed
        self.grad_chain.clear()
        self.grad_chain.update(chain)

    # ------------------------------------------------------------------ failures
    def open_gates(self) -> None:
        """After an abort: wake the optimizer thread wherever it waits."""
        for gate in self._job_gates:
            gate.force()
        for window in self.windows.values():
            window.closed.set()

    def _update_order(self, groups: Any) -> tuple[int, ...]:
        return tuple(sorted(groups, key=lambda g: (-self.store.groups[g].layer, g)))  # deep layers first

    def _job_gate(self) -> Gate:
        gate = Gate(self.abort)
        self._job_gates.append(gate)
        if len(self._job_gates) > 8 * len(self.trainable) + 64:  # keep only recent ones
            self._job_gates = [g for g in self._job_gates if not g.is_set()]
        return gate
