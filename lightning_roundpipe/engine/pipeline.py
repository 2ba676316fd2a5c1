"""``PipelineEngine``: whole batches forward and backward through the round-robin schedule.

The engine owns the host store and buffer pool and the dispatch position, which carries over from
batch to batch, and wires its collaborators: the :class:`~lightning_roundpipe.engine.crew.Crew` (the
threads and their failures), the :class:`~lightning_roundpipe.engine.planner.AutoPlanner` (which
plan the next batch runs), the :class:`~lightning_roundpipe.engine.steps.StepChain` (optimizer steps and
their ordering), the :class:`~lightning_roundpipe.engine.evaluation.Evaluator` (forward-only passes) and
the :class:`~lightning_roundpipe.engine.stats.StepStats` (what recorded batches measured). It has no
schedule of its own: :func:`~lightning_roundpipe.schedule.build.batch_schedule` makes each batch's.

Two modes. Synchronous: ``train_batch`` returns when the batch's gradients are on the host; the
caller steps its optimizer and calls :meth:`HostStore.clear_grads`. Asynchronous: ``train_batch``
returns as soon as the batch loss is known, the workers go straight on to the next batch (no drain),
and :meth:`submit_step` hands the step to the host optimizer thread.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from lightning_roundpipe.engine.cache import CacheWatch
from lightning_roundpipe.engine.crew import Crew
from lightning_roundpipe.engine.evaluation import Evaluator
from lightning_roundpipe.engine.launch import Attempt, Batch, Launcher
from lightning_roundpipe.engine.planner import AutoPlanner
from lightning_roundpipe.engine.recovery import Recovery
from lightning_roundpipe.engine.state import engine_state, load_engine_state
from lightning_roundpipe.engine.stats import StepStats, worker_waits
from lightning_roundpipe.engine.steps import StepChain, double_buffering
from lightning_roundpipe.runtime.device import WorkerDevice
from lightning_roundpipe.runtime.exchange import NodeExchange
from lightning_roundpipe.runtime.flight import Flight
from lightning_roundpipe.runtime.host_pool import HostPool
from lightning_roundpipe.runtime.host_store import HostStore
from lightning_roundpipe.runtime.microbatch import Reduction, Split, samples_of
from lightning_roundpipe.runtime.placement import OPTIMIZER_PLACES, place_states
from lightning_roundpipe.runtime.profile import records_complete
from lightning_roundpipe.runtime.updates import UpdateSpec
from lightning_roundpipe.runtime.workers import PipelineAborted
from lightning_roundpipe.schedule import OVERLAPS, Overlap, StagePlan


class PipelineEngine:
    """Forward and backward of whole batches over ``devices``, gradients accumulated in the host store.

    Args:
        layers: the layer sequence (e.g. the children of an ``nn.Sequential``); their tensors are moved
            into the engine's host store and become views of it.
        devices: one :class:`WorkerDevice` per worker (the engine gives them its host pool).
        plan: a :class:`StagePlan`, ``None`` for :meth:`StagePlan.uniform`, or ``"auto"``: measured and
            chosen by the :class:`~lightning_roundpipe.engine.planner.AutoPlanner` (with
            ``profile_steps``, ``replan_margin``, ``check_every``, ``planner`` and ``memory_limit``, the
            bytes a stage may use on a device).
        microbatches_per_round: ``M_R``, at least the number of workers, honoured wherever a batch is
            large enough (a smaller one runs as fewer micro-batches); ``None``: chosen by the planner.
        num_rounds: rounds per batch; a batch is split into ``M_R * num_rounds`` micro-batches.
        compute_dtype, autocast_dtype: dtype of the uploaded parameters (``None``: the master's) and of
            the workers' autocast (``None``: none).
        overlap: placement of weight and gradient transfers (:mod:`lightning_roundpipe.schedule.transfers`).
        seed: base seed of the layers' random streams (dropout); ``None`` draws it from torch's generator.
        max_inflight: micro-batches a worker may queue on its device beyond the one it issues (each
            costs one micro-batch of activations; more smooths host hiccups).
        asynchronous: run the optimizer on a host thread with staleness one (see the module docstring).
        consistency: ``"layerwise"`` (per-group gates) or ``"barrier"``: each step drains and casts the
            previous update on the calling thread (paper section 4.3.2's blocking baseline; same numerics).
        double_buffer: a second compute copy of ``"all"``/``True`` trainable groups, of the plan's
            ``"first"`` slot's, or ``"none"``/``False`` (:class:`~lightning_roundpipe.engine.steps.StepChain`).
        optimizer_on: ``"host"``, ``"device"`` (the trainable groups' states and updates on the one worker device:
            :mod:`~lightning_roundpipe.runtime.resident`), ``"auto"`` (there where they fit) or a share in (0, 1).
        one_pass: with ``double_buffer="all"``, build AdamW's one-pass kernel now
            (:mod:`~lightning_roundpipe.runtime.one_pass`); ``False`` where the optimizer cannot take it.
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        devices: Sequence[WorkerDevice],
        plan: StagePlan | str | None = None,
        microbatches_per_round: int | None = None,
        num_rounds: int = 1,
        compute_dtype: torch.dtype | None = None,
        autocast_dtype: torch.dtype | None = None,
        overlap: Overlap = "priority",
        seed: int | None = None,
        max_inflight: int = 3,
        asynchronous: bool = False,
        consistency: str = "layerwise",
        profile_steps: int = 2,
        replan_margin: float = 0.25,
        check_every: int = 50,
        planner: str = "fastest",
        memory_limit: float | None = None,
        double_buffer: bool | str = False,
        optimizer_on: str | float = "host",
        one_pass: bool = True,
    ) -> None:
        self.layers, self.devices = list(layers), list(devices)
        self.num_workers = len(self.devices)
        self.overlap, self.asynchronous, self.consistency = overlap, asynchronous, consistency
        buffers = double_buffering(double_buffer)
        _check_arguments(self, microbatches_per_round, num_rounds, buffers, optimizer_on)
        self.pool = HostPool(pin=any(d.device.type == "cuda" for d in devices))
        self.planner = AutoPlanner(  # checks the plan and planner arguments before the layers move
            plan, len(self.layers), self.num_workers, microbatches_per_round, num_rounds, asynchronous,
            self.pool, profile_steps, replan_margin, check_every, planner, memory_limit,
        )  # fmt: skip
        self.store = HostStore(self.layers, compute_dtype, separate_compute=asynchronous)
        eligible = asynchronous and consistency == "layerwise" and autocast_dtype != torch.float16  # (fp16: scaled)
        self.resident = place_states(optimizer_on, self.store, devices, eligible, memory_limit, self.planner.transfers)
        if self.resident is not None:  # the states on the device, the plan's stages under what is left
            self.planner.memory_limit = self.resident.plan_limit(memory_limit)
        self.base_seed = int(torch.randint(0, 2**62, ()).item()) if seed is None else seed
        self.crew = Crew(
            self.layers, self.devices, self.store, self.pool, self.plan, self.base_seed, autocast_dtype, overlap,
            max_inflight, asynchronous,
        )  # fmt: skip
        _register_for_dma(self.store, self.pool, self.resident is not None)
        self.steps = StepChain(
            self.store, self.pool, self.crew.abort, self.crew.optimizer, self.crew.fail, self.plan,
            buffers, frozenset() if self.resident is None else self.resident.held, one_pass,  # (held: two copies)
        )  # fmt: skip
        self.crew.when_aborted(self.steps.open_gates)
        self.recovery = Recovery(self.planner, self.steps, self.store, self.crew)
        guards, give_back = self.recovery.guards, self.recovery.give_back
        self.launcher = Launcher(self.store, self.pool, self.crew, self.steps, self.planner, overlap, guards, give_back)
        self.evaluator = Evaluator(self.store, self.pool, self.crew, self.steps, self.planner, overlap)
        self.stats = StepStats(self.num_workers)
        self.caches = CacheWatch(self.devices, self.planner, self.store, ceiling=memory_limit)  # states included
        self.crew.use_resident(self.resident)
        self.dispatch_position = 0  # the worker the next batch's first slot goes to
        self.calls = 0  # batches run so far: part of every layer's random seed
        self._recording: list[Flight] = []

    @property
    def plan(self) -> StagePlan:
        return self.planner.plan  # what the next batch runs

    @property
    def num_microbatches(self) -> int:
        return self.planner.num_microbatches  # of a batch large enough; the planner may choose it

    @property
    def worker_waits(self) -> dict[str, float]:
        """Seconds per batch the workers waited, by reason, over the last finished batches."""
        return worker_waits(self.crew.recent)

    def use_exchange(self, exchange: NodeExchange) -> None:
        """Several nodes, asynchronous mode: the optimizer thread exchanges gradients and weights (nodes.py)."""
        if self.crew.optimizer is None or self.resident is not None:
            raise RuntimeError("several nodes exchange through the asynchronous host optimizer: optimizer_on='host'")
        self.crew.optimizer.exchange = exchange

    def set_plan(self, plan: StagePlan) -> None:
        """Switch plans between batches: each flight carries its own schedule, so nothing drains."""
        self.planner.set_plan(plan, self.calls)
        self.stats.new_plan()  # another first slot
        self.planner.predict(self.stats.handoff)
        self.pool.trim_idle()  # buffers of the old boundaries and micro-batch sizes would only idle

    # ------------------------------------------------------------------ one batch
    def train_batch(
        self,
        inputs: Any,
        target: Any,
        loss_fn: Callable[[Any, Any], Tensor],
        reduction: Reduction = "mean",
        grad_scale: float = 1.0,
        last_of_step: bool = False,
        split: Split | None = None,
    ) -> Tensor:
        """Forward and backward of one batch; gradients of ``grad_scale * loss`` are added to the host
        store. Returns the batch loss (detached), as ``loss_fn`` would give on the whole batch. ``split``
        cuts it into micro-batches instead of the split along dim 0 (a language model's by tokens).

        ``last_of_step`` (asynchronous mode): no further batch joins this step before :meth:`submit_step`, so
        the previous update may be cast into each weight this step no longer uploads during the step (edge 1
        of :mod:`~lightning_roundpipe.runtime.optimizer_worker`); a batch after a promised last one is refused."""
        self.crew.check_usable()
        self.steps.check_open()
        self.store.check_training()  # frozen or unfrozen since the build, or a batch norm updating its statistics
        if self.resident is not None and self.resident.host_changed():  # a loaded checkpoint, say: take it up
            self.flush()
            self.resident.from_host(self.steps.step)
        self.stats.submitted(self.calls)
        self._harvest()  # a measurement just finished may change the plan and micro-batch count of this batch
        batch = Batch(inputs, target, loss_fn, reduction, grad_scale, samples_of(inputs, target, split), split)
        if (plan := self.caches.next_plan(self.calls, batch.samples)) is not None:
            self.set_plan(plan)  # the allocators kept giving memory back: a smaller plan on trial, or the end of one
        # a padded batch's micro-batches at any count, for a planner that plans them (a fixed plan reads none)
        noted = self.planner.auto and self.planner.shapes.note(split, inputs, target)
        row = batch.elements / max(1, batch.samples)
        if (plan := self.planner.widen(self.store, batch.samples, row, noted)) is not None:
            self.set_plan(plan)  # wider (longer) samples than the plan was made for: its plan from the same costs
        start = self.dispatch_position
        attempt = self._launch(batch, self.calls, start)
        flight, self.calls = attempt.flight, self.calls + 1
        self.caches.ran(flight.call, sum(flight.microbatch_elements))
        if attempt.mark is not None:  # settles; out of device memory it runs again on a smaller plan
            relaunch = partial(self._relaunch, batch, flight.call, start)
            flight = self.recovery.settle(attempt, relaunch, None if self.asynchronous else self.recovery.drop)
            if self.asynchronous:
                self.steps.joined(flight, last_of_step)
            self.recovery.succeeded(batch.largest)
        elif self.asynchronous:
            self.steps.joined(flight, last_of_step)
            try:
                loss = flight.wait_losses()
            except PipelineAborted:
                self.crew.fail()
            self.crew.prune()
            self.stats.returned()
            return loss
        else:
            self.crew.settle(attempt.tasks, lambda: self.recovery.drop(flight))
        self._harvest(wait=True)
        loss = flight.batch_loss()
        self.stats.returned()
        return loss

    def _launch(self, batch: Batch, call: int, first_worker: int, skip: frozenset[int] | None = None) -> Attempt:
        """Dispatch ``batch`` as batch number ``call`` (``skip``: it runs again, those groups done)."""
        attempt = self.launcher.launch(batch, call, first_worker, skip is not None, skip or frozenset())
        self.dispatch_position = attempt.flight.schedule.next_first_worker
        if attempt.flight.record:
            self._recording.append(attempt.flight)
        return attempt

    def _relaunch(
        self, batch: Batch, call: int, first_worker: int, failed: Flight, skip: frozenset[int], plan: StagePlan
    ) -> Attempt:
        """Run batch ``call`` again on ``plan`` after ``failed`` ran out of device memory."""
        if failed in self._recording:
            self._recording.remove(failed)
        self.set_plan(plan)
        return self._launch(batch, call, first_worker, skip)

    def _harvest(self, wait: bool = False) -> None:
        """Use the timings of recorded batches whose work is done (``wait``: wait for them)."""
        pending = []
        for flight in self._recording:
            if not self.crew.finished(flight) or not (wait or records_complete(flight)):
                pending.append(flight)
                continue
            if wait:
                self.crew.synchronize()
            if self.stats.use(flight, self.plan):
                self.planner.predict(self.stats.handoff)
            new_plan = self.planner.use(flight, self.store)
            if new_plan is not None:
                self.set_plan(new_plan)
        self._recording = pending

    # ------------------------------------------------------------------ steps, evaluation, checkpoints
    def submit_step(self, spec: UpdateSpec) -> None:
        """Hand the current step's update to the optimizer worker and start the next step."""
        if not self.asynchronous:
            raise RuntimeError("submit_step needs an engine built with asynchronous=True")
        self.crew.check_usable()
        if self.resident is not None and spec.scaler is not None:
            raise ValueError("optimizer_on='device' does not scale losses (precision='16-mixed'): use bf16")
        if self.consistency == "barrier" and self.steps.windows[self.steps.step].flights:
            self.flush()  # drain, then cast the previous update here, all groups at once
            self.steps.cast_previous_here()
        self.steps.submit(spec, cast=self.consistency == "layerwise")

    def flush(self) -> None:
        """Wait until every batch's gradients are collected and every submitted update reached the
        masters (checkpoints, validation and teardown need this). Casts for the next step may remain.
        After a failure (no thread runs): the device's values to the host, for a checkpoint of whole steps."""
        if self.crew.after_failure(self.steps.step):
            return
        self.crew.wait_live()
        self.crew.drain()
        if self.crew.optimizer is not None:
            self.crew.optimizer.wait_math()  # (and what the steps keep in the groups, a step count, reaches them)
        self.crew.prune()
        if self.crew.error is not None:
            self.crew.fail()
        if self.resident is not None:
            self.resident.to_host(self.steps.step)
        self._harvest(wait=True)

    def begin_evaluation(self) -> None:
        """Make the compute copies hold the masters for forward-only passes (see :meth:`Evaluator.begin`)."""
        self.crew.check_usable()
        self.flush()
        self.stats.skip_turn()  # the host's turn between batches must not count this pass
        self.evaluator.begin()

    def end_evaluation(self) -> None:
        """Put back the compute copies :meth:`begin_evaluation` set aside."""
        self.evaluator.end()
        self.caches.forget()  # what the pass allocated and freed says nothing about the training plan

    def evaluate(
        self,
        inputs: Any,
        target: Any = None,
        loss_fn: Callable[[Any, Any], Tensor] | None = None,
        reduction: Reduction = "mean",
        split: Split | None = None,
    ) -> Any:
        """Forward only, through the pipeline: the batch loss (as ``loss_fn`` on the whole batch) or, with
        ``loss_fn=None``, the outputs concatenated along dim 0. Training's counters, seeds and gradients
        are untouched; call between :meth:`begin_evaluation` and :meth:`end_evaluation`. ``split``: as for
        :meth:`train_batch`, for a loss only (outputs keep the batch's order)."""
        self.crew.check_usable()
        return self.evaluator.run(inputs, target, loss_fn, reduction, self.dispatch_position, split)

    def state_dict(self) -> dict[str, Any]:
        """What resuming exactly needs besides the weights and the optimizer (:mod:`.state`)."""
        self.flush()
        if not self.crew.failed:  # (after one the pending update may be cast in part: the next step reads the masters)
            self.steps.settle_early_casts()
        return engine_state(self, compute=not self.crew.failed)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where :meth:`state_dict` left off: on a new engine, before its first batch."""
        if self.calls or self.crew.busy():
            raise RuntimeError("load the roundpipe engine state before the first batch")
        load_engine_state(self, state)

    # ------------------------------------------------------------------ failures and close-down
    def close(self) -> None:
        """Finish pending updates, stop every thread and unpin host memory; idempotent."""
        if self.crew.closed:
            return
        try:
            if self.asynchronous and not self.crew.failed and self.crew.error is None:
                self.flush()
                self.steps.windows[self.steps.step].closed.set()  # no more batches: pending casts may proceed
                assert self.crew.optimizer is not None
                self.crew.optimizer.wait_all(timeout=60.0)
        finally:
            stuck = self.crew.close()
            if self.resident is not None and not stuck:  # after a failure too: the device's values to the module
                self.resident.rescue(self.steps.step)
            if stuck:
                warnings.warn(f"roundpipe threads did not stop in time: {stuck}", stacklevel=2)
            else:
                self.pool.close()


def _register_for_dma(store: HostStore, pool: HostPool, resident: bool) -> None:
    """Page-lock what travels by DMA: the weights, the first gradient writes and (states on the device) the masters."""
    for group in store.groups:
        own = group.trainable and group.data.data_ptr() != group.compute.data_ptr()  # (not one buffer)
        for tensor in (group.compute, group.grad, group.data if own and resident else None):
            if tensor is not None:
                pool.register(tensor)


def _check_arguments(
    engine: PipelineEngine, microbatches_per_round: int | None, num_rounds: int, double_buffer: str, optimizer_on: Any
) -> None:
    """Refuse arguments the engine cannot run with, before anything is allocated."""
    if not engine.layers:
        raise ValueError("the model has no layers to pipeline: pass a non-empty nn.Sequential")
    if not engine.devices:
        raise ValueError("the engine needs at least one worker device")
    if engine.overlap not in OVERLAPS:
        raise ValueError(f"overlap={engine.overlap!r} is not one of {OVERLAPS}")
    if microbatches_per_round is not None and microbatches_per_round < engine.num_workers:
        raise ValueError(
            f"num_microbatches={microbatches_per_round} per round is fewer than the {engine.num_workers}"
            f" workers: each worker would idle. Use num_microbatches >= {engine.num_workers}, or leave it unset"
            " (a batch too small for it runs as fewer micro-batches anyway)."
        )
    if num_rounds < 1:
        raise ValueError(f"num_rounds must be at least 1, got {num_rounds}")
    if engine.consistency not in ("layerwise", "barrier"):
        raise ValueError(f"consistency={engine.consistency!r} is not 'layerwise' or 'barrier'")
    share = isinstance(optimizer_on, float) and 0.0 < optimizer_on < 1.0
    if optimizer_on not in OPTIMIZER_PLACES and not share:
        raise ValueError(f"optimizer_on={optimizer_on!r} is not one of {OPTIMIZER_PLACES} or a share in (0, 1)")
    if (optimizer_on == "device" or share) and (engine.num_workers, engine.asynchronous, engine.consistency) != (
        1, True, "layerwise"):  # fmt: skip
        raise ValueError(
            f"optimizer_on={optimizer_on!r} is for one worker device and the asynchronous, layerwise optimizer"
        )
    if double_buffer != "none" and not engine.asynchronous:
        raise ValueError(f"double_buffer={double_buffer!r} is for the asynchronous optimizer (asynchronous=True)")
