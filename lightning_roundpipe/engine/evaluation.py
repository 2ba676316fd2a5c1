"""Forward-only passes (validation, test, predict) through the same pipeline as training.

A pass runs a flight marked ``evaluating`` on a forward-only schedule: the forward stages and the fused
stage, which computes the loss or the output under ``no_grad``. It has its own gradient-order tables
and negative call numbers, so training's gates, seeds, counters and dispatch position are untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_roundpipe.engine.crew import Crew
from lightning_roundpipe.engine.planner import AutoPlanner
from lightning_roundpipe.engine.steps import StepChain
from lightning_roundpipe.runtime.flight import Flight
from lightning_roundpipe.runtime.host_pool import HostPool, Parcel
from lightning_roundpipe.runtime.host_store import HostStore
from lightning_roundpipe.runtime.microbatch import Reduction, Split, cut, microbatch_weights, samples_of, split_batch
from lightning_roundpipe.schedule.build import batch_schedule
from lightning_roundpipe.schedule.transfers import Overlap


class Evaluator:
    """Runs forward-only batches, and keeps the weights evaluated equal to the masters."""

    def __init__(
        self, store: HostStore, pool: HostPool, crew: Crew, steps: StepChain, planner: AutoPlanner, overlap: Overlap
    ) -> None:
        self.store, self.pool, self.crew, self.steps, self.overlap = store, pool, crew, steps, overlap
        self.planner = planner
        self.stash: dict[int, Tensor] | None = None
        """Asynchronous mode, between :meth:`begin` and :meth:`end`: the compute copies set aside."""
        self._calls = 0

    def begin(self) -> None:
        """Make the compute copies hold the masters, as plain training would evaluate them (after a flush).

        Synchronous mode: refresh what the last optimizer step changed. Asynchronous mode: the masters
        hold the last update but the next training batch must still compute without it (staleness 1),
        so the compute copies of the groups with a pending cast are set aside and restored by
        :meth:`end` (a transient extra 2 bytes per trainable parameter in bf16).
        """
        if not self.steps.asynchronous:
            self.store.sync_compute()
            return
        self.steps.settle_early_casts()
        if self.stash is None:
            step, pending = self.steps.step, self.steps.pending_casts()
            self.stash = {g: self.store.reads(g, step).clone() for g in pending}
            for g in pending:
                self.store.reads(g, step).copy_(self.store.groups[g].data)

    def end(self) -> None:
        """Put back the compute copies :meth:`begin` set aside."""
        stash, self.stash = self.stash, None
        for g, compute in (stash or {}).items():
            self.store.reads(g, self.steps.step).copy_(compute)

    def run(
        self,
        inputs: Any,
        target: Any,
        loss_fn: Callable[[Any, Any], Tensor] | None,
        reduction: Reduction,
        first_worker: int,
        split: Split | None = None,
    ) -> Any:
        """The batch loss, or the outputs with ``loss_fn=None`` (see ``PipelineEngine.evaluate``)."""
        if not self.steps.asynchronous:
            self.store.sync_compute()
        # a small batch (the last of a validation set) runs as fewer micro-batches, one round: nothing is
        # kept for backward, so the micro-batch count changes no number, only how the work is spread
        size = samples_of(inputs, target, split if loss_fn is not None else None)
        plan, per_round, rounds = self.planner.plan, self.planner.microbatches_per_round, self.planner.num_rounds
        if size < per_round * rounds:
            per_round, rounds = size, 1
        how = f"num_microbatches={per_round} per round x num_rounds={rounds}"
        if split is not None and loss_fn is not None:
            mb_inputs, mb_targets = cut(split, inputs, target, per_round * rounds, how)
        else:
            mb_inputs, mb_targets = split_batch(inputs, target, per_round * rounds, how)
        weights = microbatch_weights(mb_targets, mb_inputs, reduction) if loss_fn is not None else []
        schedule = batch_schedule(
            plan, self.crew.num_workers, per_round, rounds, first_worker, self.overlap, forward_only=True
        )
        # staged buffers go back to a pool the workers reuse: never let them be inference tensors
        # (trainer.validate/test/predict run under torch.inference_mode)
        with torch.inference_mode(False):
            n = len(mb_targets) if loss_fn is not None else 0
            parcels = self.pool.stage_all([*mb_targets[:n], *mb_inputs])
            targets = parcels[:n] if loss_fn is not None else [Parcel(None)] * len(mb_inputs)
            staged = parcels[n:]
        self._calls += 1
        flight = Flight(
            -self._calls, schedule, targets, weights, 1.0, loss_fn, self.crew.abort, self.pool, {},
            self.steps.slot_groups(plan).__getitem__, set(), evaluating=True, step=self.steps.step,
        )  # fmt: skip
        for m, x in enumerate(staged):
            flight.put(("act", 0, m), x)
        tasks = self.crew.launch(flight, settle=True)

        def recover() -> None:
            flight.release_all()
            self.crew.reset()  # ready again, as after a failed training batch

        self.crew.settle(tasks, None if self.steps.asynchronous else recover)
        if loss_fn is not None:
            return flight.batch_loss()
        return _concatenate([self._take_output(p) for p in flight.losses])

    def _take_output(self, parcel: Parcel | None) -> Any:
        assert parcel is not None
        if parcel.ready is not None:
            parcel.ready.synchronize()
        leaves, spec = tree_flatten(parcel.value)
        owned = tree_unflatten([t.clone() if isinstance(t, Tensor) else t for t in leaves], spec)
        self.pool.release(parcel)
        return owned


def _concatenate(outputs: list[Any]) -> Any:
    """Micro-batch outputs joined back into the batch's: tensors concatenated along dim 0, other
    leaves taken from the first micro-batch."""
    flat = [tree_flatten(o) for o in outputs]
    spec = flat[0][1]
    leaves = [
        torch.cat([f[0][i] for f in flat]) if isinstance(flat[0][0][i], Tensor) and flat[0][0][i].dim() > 0
        else flat[0][0][i]
        for i in range(len(flat[0][0]))
    ]  # fmt: skip
    return tree_unflatten(leaves, spec)
