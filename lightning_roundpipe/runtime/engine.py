"""The pipeline engine: runs whole batches forward and backward through the round-robin schedule.

It owns the host store, the host buffer pool, one executor, one worker thread and one gradient
collector per device, the optional asynchronous optimizer, and the dispatch position, which carries
over from batch to batch. The engine has no schedule of its own: it builds the schedule from the plan
with :mod:`lightning_roundpipe.schedule` and hands each worker its list.

Two modes. Synchronous: ``train_batch`` returns when the batch's gradients are on the host; the
caller steps its optimizer and calls :meth:`HostStore.clear_grads`. Asynchronous: ``train_batch``
returns as soon as the batch loss is known, the workers go straight on to the next batch (no drain),
and :meth:`submit_step` hands the step to the host optimizer worker (see
:mod:`~lightning_roundpipe.runtime.optimizer_worker` for the ordering protocol).
"""

from __future__ import annotations

import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict
from functools import partial
from statistics import median
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_roundpipe.runtime.collector import GradCollector
from lightning_roundpipe.runtime.device import WorkerDevice
from lightning_roundpipe.runtime.exchange import NodeExchange
from lightning_roundpipe.runtime.executor import StageExecutor, plain_attributes
from lightning_roundpipe.runtime.flight import Flight
from lightning_roundpipe.runtime.host_pool import HostPool, Parcel
from lightning_roundpipe.runtime.host_store import HostStore
from lightning_roundpipe.runtime.microbatch import Reduction, batch_size, microbatch_weights, split_batch
from lightning_roundpipe.runtime.optimizer_worker import OptimizerWorker, StepWindow, UpdateJob, UpdateSpec
from lightning_roundpipe.runtime.profile import (
    LayerProfile,
    busy_seconds,
    drift,
    records_complete,
    stage_times,
    timeline,
)
from lightning_roundpipe.runtime.workers import Gate, PipelineAborted, Task, WorkerPool
from lightning_roundpipe.schedule import OVERLAPS, Overlap, Schedule, StagePlan, add_transfers, round_robin, validate
from lightning_roundpipe.schedule.choose import PLANNERS, automatic_plan
from lightning_roundpipe.schedule.partition import LayerCosts
from lightning_roundpipe.schedule.partition import stage_times as stage_times_of_plan
from lightning_roundpipe.schedule.simulate import simulate


class PipelineEngine:
    """Forward and backward of whole batches over ``devices``, gradients accumulated in the host store.

    Args:
        layers: the layer sequence (e.g. the children of an ``nn.Sequential``); their tensors are
            moved into the engine's host store and become views of it.
        devices: one :class:`WorkerDevice` per worker (the engine gives them its host pool).
        plan: the stage plan; ``None`` picks :meth:`StagePlan.uniform`; ``"auto"`` measures the layers
            for ``profile_steps`` batches (one layer per stage), then plans from their costs (see
            ``planner``), and measures stage times every
            ``check_every`` batches: when they drift by more than ``replan_margin`` from those the
            plan first measured, twice in a row, it measures and plans again (and once more if that
            first timing is itself off the measured costs by the margin).
        planner: how ``"auto"`` picks its plan from the measured costs (see
            :func:`~lightning_roundpipe.schedule.choose.automatic_plan`).
        microbatches_per_round: ``M_R``, at least the number of workers; ``None`` means workers + 1.
        num_rounds: rounds per batch; a batch is split into ``M_R * num_rounds`` micro-batches.
        compute_dtype: dtype of the parameters uploaded to workers (``None``: the master's dtype).
        autocast_dtype: autocast dtype for the workers' compute, ``None`` for none.
        overlap: placement of weight and gradient transfers, see
            :mod:`lightning_roundpipe.schedule.transfers`.
        seed: base seed of the per-layer random streams (dropout); ``None`` draws it from torch's
            global generator, so ``seed_everything`` makes runs repeatable.
        max_inflight: micro-batches a worker may have queued on its device beyond the one it is
            issuing; more smooths host hiccups, each costs one micro-batch of activations.
        asynchronous: run the optimizer on a host thread with staleness one (see the module docstring).
        consistency: ``"layerwise"`` (per-group gates, no barrier) or ``"barrier"``: each step drains
            the pipeline and casts the previous update into the compute copies on the calling thread
            (the blocking baseline of paper section 4.3.2, for comparison; same numerics).
        memory_limit: bytes a stage may use on a device, for the partitioner (``None``: no limit).
        double_buffer: asynchronous mode: a second compute copy of trainable groups, so update ``k``
            is cast as soon as its math is done instead of after step ``k + 1``'s last upload of the
            group. The first stage's weights are uploaded last in a step (by its last backward stage)
            and first in the next: without it the next step's first kernel waits for their cast (see
            docs/perf-notes.md). ``"all"`` (or ``True``): every trainable group (+2 bytes per trainable
            parameter in bf16); ``"first"``: the groups the plan's first slot reads (grown when the plan
            changes, never shrunk); ``"none"`` (or ``False``).
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
    ) -> None:
        layers = list(layers)
        if not layers:
            raise ValueError("the model has no layers to pipeline: pass a non-empty nn.Sequential")
        if not devices:
            raise ValueError("the engine needs at least one worker device")
        if overlap not in OVERLAPS:
            raise ValueError(f"overlap={overlap!r} is not one of {OVERLAPS}")
        self.auto_plan = plan == "auto"
        if isinstance(plan, str) and not self.auto_plan:
            plan = StagePlan.parse(plan)
        self.plan: StagePlan = (
            LayerProfile.plan(len(layers)) if self.auto_plan else plan or StagePlan.uniform(len(layers))  # type: ignore[assignment]
        )
        self.plan.check_layers(len(layers))
        self.profile_steps = profile_steps
        self.replan_margin = replan_margin
        self.check_every = check_every
        if planner not in PLANNERS:
            raise ValueError(f"planner={planner!r} is not one of {PLANNERS}")
        if replan_margin <= 0:
            raise ValueError(f"replan_margin={replan_margin} must be above 0")
        self.planner = planner
        self.memory_limit = memory_limit
        self.layer_costs: LayerCosts | None = None
        """Measured per-layer costs (after profiling), what the plan was computed from."""
        self.predicted_bubble: float | None = None
        """The simulator's bubble ratio for the current plan and measured costs."""
        self.busy: dict[int, float] = {}
        """Per worker, the fraction of the last measured step its device spent computing."""
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
        self._profile: LayerProfile | None = LayerProfile(len(layers)) if self.auto_plan else None
        self._recording: list[Flight] = []
        self._drifted = 0
        self.drift: float | None = None
        """At the last check, how far stage times moved from those first measured on the plan
        (relative to the slowest stage); ``replan_margin`` twice in a row measures the layers again."""
        self._reference: list[float] | None = None  # the plan's stage times at its first check
        self._offset_checked = False  # the costs were measured again for a plan's first-timing offset
        self._plan_since = 0  # the first call on the current plan
        self._record_next = False
        self._submitted: dict[int, float] = {}  # call -> when it was submitted (recent calls only)
        self.handoff: float | None = None
        """Seconds from a batch's last loss to the earliest start of the next batch's first slot, as
        the simulator charges it: the host's turn between two batches (from :meth:`train_batch`
        returning to its next call), the first slot's wait for the casts of its weights (one compute
        copy: the cast of update ``k - 1`` waits for step ``k``'s last read) and the upload of its
        weights (medians of recent measured batches; updated, and the prediction with it, when it
        moves by more than 5%)."""
        self._returned: float | None = None
        self._turns: deque[float] = deque(maxlen=5)
        self._first_uploads: deque[float] = deque(maxlen=5)
        self.num_workers = len(devices)
        self.microbatches_per_round = microbatches_per_round or self.num_workers + 1
        if self.microbatches_per_round < self.num_workers:
            raise ValueError(
                f"num_microbatches={self.microbatches_per_round} per round is fewer than the {self.num_workers}"
                f" workers: each worker would idle. Use num_microbatches >= {self.num_workers}."
            )
        if num_rounds < 1:
            raise ValueError(f"num_rounds must be at least 1, got {num_rounds}")
        self.num_rounds = num_rounds
        self.overlap = overlap
        if consistency not in ("layerwise", "barrier"):
            raise ValueError(f"consistency={consistency!r} is not 'layerwise' or 'barrier'")
        self.consistency = consistency
        self.asynchronous = asynchronous
        self.layers = layers
        self.devices = list(devices)
        self.pool = HostPool(pin=any(d.device.type == "cuda" for d in devices))
        self.double_buffer = double_buffering(double_buffer)
        if self.double_buffer != "none" and not asynchronous:
            raise ValueError(f"double_buffer={double_buffer!r} is for the asynchronous optimizer (asynchronous=True)")
        self.store = HostStore(layers, compute_dtype, separate_compute=asynchronous)
        self._grad_groups: dict[StagePlan, dict[int, tuple[int, ...]]] = {}
        spares = []
        if self.double_buffer == "all":
            spares = self.store.add_spares()
        elif self.double_buffer == "first":
            spares = self.store.add_spares(self._slot_grad_groups(self.plan)[0])  # no batch yet: any time is right
        for group in self.store.groups:
            self.pool.register(group.compute)
            if group.grad is not None:
                self.pool.register(group.grad)  # first gradient writes land here by DMA
        for spare in spares:
            self.pool.register(spare)
        self.base_seed = int(torch.randint(0, 2**62, ()).item()) if seed is None else seed
        self.dispatch_position = 0
        """Worker the next batch's first slot goes to."""
        self.calls = 0
        """Batches run so far; part of every layer's random seed."""
        self.step = 0
        """Optimizer step the next batch belongs to (asynchronous mode)."""
        self.trace: list[tuple[Any, ...]] | None = None
        self._abort = threading.Event()
        self._error: BaseException | None = None
        self._error_lock = threading.Lock()
        self._failed = False
        self._live: list[tuple[Flight, list[Task]]] = []
        self._job_gates: list[Gate] = []
        self._windows: dict[int, StepWindow] = {0: StepWindow(self._abort)}
        self._cast_done: dict[int, dict[int, Gate]] = {}
        self._evaluation_stash: dict[int, Tensor] | None = None
        self._eval_schedules: dict[tuple[StagePlan, int, int, int], Schedule] = {}
        self._eval_calls = 0
        self._closed = False
        self._warned_empty = False
        self._boundary_bytes = 0
        """Of the last recorded batch: the largest activation a micro-batch handed between two layers."""
        self._warned_measuring = False
        self._collectors = []
        self._executors = []
        for i, device in enumerate(devices):
            device.pool = self.pool
            collector = GradCollector(f"roundpipe-collector-{i}", device, self.store, self._on_worker_error)
            self._collectors.append(collector)
            self._executors.append(
                StageExecutor(
                    device,
                    self.store,
                    layers,
                    self.plan,
                    self.base_seed,
                    autocast_dtype,
                    collector,
                    self._on_worker_error,
                    overlap,
                    max_inflight,
                )
            )
        self._trainable = tuple(g.index for g in self.store.groups if g.trainable)
        self._schedules: dict[tuple[StagePlan, int], Schedule] = {}
        self._grad_chain: dict[int, Gate] = {}
        self._optimizer = OptimizerWorker(self.store, self._on_worker_error) if asynchronous else None
        self._pool = WorkerPool(
            [f"roundpipe-worker-{i}" for i in range(self.num_workers)],
            [d.enter_thread for d in devices],
            self._on_worker_error,
        )

    def use_exchange(self, exchange: NodeExchange) -> None:
        """Data parallelism across nodes, asynchronous mode: the optimizer thread sends each gradient group
        to the node that owns it once complete, updates the groups this node owns and broadcasts them
        (overlapping the rest of the backward and the next step)."""
        if self._optimizer is None:
            raise RuntimeError("use_exchange is for the asynchronous engine; the strategy exchanges synchronously")
        self._optimizer.exchange = exchange

    @property
    def num_microbatches(self) -> int:
        return self.microbatches_per_round * self.num_rounds

    def record_trace(self) -> list[tuple[Any, ...]]:
        """Start recording when each action and each group update started (for tests and timelines)."""
        self.trace = []
        for executor in self._executors:
            executor.trace = self.trace
        if self._optimizer is not None:
            self._optimizer.trace = self.trace
        return self.trace

    def schedule(self, first_worker: int) -> Schedule:
        """The validated schedule of a batch starting at ``first_worker`` under the current plan."""
        key = (self.plan, first_worker)
        if key not in self._schedules:
            compute_only = round_robin(
                self.plan, self.num_workers, self.microbatches_per_round, self.num_rounds, first_worker
            )
            s = add_transfers(compute_only, self.overlap)
            validate(s)
            self._schedules[key] = s
        return self._schedules[key]

    def _slot_grad_groups(self, plan: StagePlan) -> dict[int, tuple[int, ...]]:
        if plan not in self._grad_groups:
            self._grad_groups[plan] = {
                stage.slot: tuple(g for g in self.store.groups_of(stage.layers) if self.store.groups[g].trainable)
                for stage in plan.stages()
            }
        return self._grad_groups[plan]

    # ------------------------------------------------------------------ measuring and planning
    def replan(self) -> None:
        """Measure the layers again (one layer per stage) and plan from the new costs. The plan that
        follows gets its own second look if its first timing is off these costs."""
        self._profile = LayerProfile(len(self.layers))
        self.plan = LayerProfile.plan(len(self.layers))
        self._drifted, self._reference, self.drift, self._offset_checked = 0, None, None, False

    def log_gradient_adds(self, log: list[tuple[float, float, float, int]] | None) -> None:
        """Append every gradient job's (start of the wait for its copy, start of its host adds, their
        end, bytes added) to ``log``, in ``time.perf_counter`` seconds; ``None`` stops. For benchmarks:
        where a batch's tail goes."""
        for collector in self._collectors:
            collector.log = log

    def measure_next(self) -> None:
        """Record the next batch's compute times (for :attr:`busy` and drift checks)."""
        self._record_next = True

    def _wants_record(self) -> bool:
        if self._profile is not None or self._record_next:
            return True
        return self.auto_plan and self.check_every > 0 and self.calls % self.check_every == 0

    def _harvest(self, wait: bool = False) -> None:
        """Use the timings of recorded batches whose work is done (``wait``: wait for them)."""
        pending = []
        for flight in self._recording:
            done = all(t.done.is_set() for f, tasks in self._live if f is flight for t in tasks)
            if not done or not (wait or records_complete(flight)):
                pending.append(flight)
                continue
            if wait:
                for device in self.devices:
                    device.synchronize()
            self._use_measurements(flight)
        self._recording = pending

    def _use_measurements(self, flight: Flight) -> None:
        self._boundary_bytes = flight.boundary_bytes or self._boundary_bytes
        self.last_timeline = timeline(flight)
        self.last_timeline_origin = min(host for _, host in flight.references.values())
        period = self._period(flight.call)
        busy = busy_seconds(flight)
        if period is not None:
            self.busy = {w: min(1.0, s / period) for w, s in busy.items()}
        if len(flight.first_upload) == 2 and flight.schedule.plan == self.plan:
            self._first_uploads.append(flight.cast_wait + WorkerDevice.elapsed(*flight.first_upload))
            if self._turns:
                handoff = median(self._turns) + median(self._first_uploads)
                # simulating takes milliseconds on the main thread before a dispatch: only for a change
                if self.handoff is None or abs(handoff - self.handoff) > 0.05 * self.handoff:
                    self.handoff = handoff
                    self._predict()
        if self.last_timeline:
            span = max(row[3] for row in self.last_timeline) - min(row[2] for row in self.last_timeline)
            if span > 0:
                self.bubble_in_step = max(0.0, 1.0 - sum(busy.values()) / (self.num_workers * span))
                self.host_gap = None if period is None else max(0.0, 1.0 - span / period)
        if self._profile is not None and flight.schedule.plan == LayerProfile.plan(len(self.layers)):
            self._profile.add(flight)
            if self._profile.batches >= self.profile_steps:
                self.layer_costs = self._profile.costs(self.store)
                self._profile = None
                self._set_plan(
                    automatic_plan(
                        self.layer_costs, self.num_workers, self.num_microbatches, self.memory_limit,
                        self.planner, self.asynchronous,
                    ).plan
                )  # fmt: skip
            return
        if self._is_check(flight):
            self._check_drift(stage_times(flight), flight.call)

    def _check_drift(self, times: dict[int, list[float]], call: int) -> None:
        """Stage times against the plan's own first timing, not against the sums of per-layer costs: a
        stage of several layers runs at its own pace (launch gaps, waits for chunked uploads), and an
        offset from the sums that every measurement shows would measure, partition, land on the same
        plan and measure again forever (seen on 2 H200s). An offset at the plan's first timing gets one
        more measurement (a slowdown right after profiling, one-offs in the first profile); what
        remains after it is the plan's pace."""
        if call <= self._plan_since:  # not the plan's first batch (allocations, first casts; or a resume's)
            return
        if self._reference is None:
            slots = range(self.plan.num_slots)
            if not all(times.get(slot) for slot in slots):
                return
            assert self.layer_costs is not None
            if not self._offset_checked and drift(times, stage_times_of_plan(self.layer_costs, self.plan)) > (
                self.replan_margin
            ):
                fits = self._measuring_fits()
                if fits:
                    self.replan()
                self._offset_checked = True  # the plan from this measurement gets no further look
                if fits:
                    return
            self._reference = [median(times[slot]) for slot in slots]
            return
        self.drift = drift(times, self._reference)
        self._drifted = self._drifted + 1 if self.drift > self.replan_margin else 0
        if self._drifted >= 2:
            if self._measuring_fits():
                self.replan()
            else:
                self._drifted = 0

    def _measuring_fits(self) -> bool:
        """Whether the host can hold a batch under the measuring plan. One layer per stage keeps every
        layer's input on the host until its backward, where a plan keeps only its backward stages'
        inputs: at long sequences that can be twice the host memory of a planned batch (by arithmetic on
        one H200 at 327,680 tokens: 57 boundaries of 1.25 GiB against the plan's 29). A run that fits its
        plan must not die of a re-measurement hours in; it keeps its plan instead, and says so once.

        The estimate takes every boundary as wide as the widest the last recorded batch passed (a
        decoder's are all one hidden state wide), two rounds of micro-batches alive at once (workers
        overlap a round's backward with the next one's forward), and, in asynchronous mode, two batches."""
        measuring = len(LayerProfile.plan(len(self.layers)).saved_boundaries())
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

    def _is_check(self, flight: Flight) -> bool:
        """A batch recorded for the drift check (every ``check_every``), on the current automatic plan.
        Batches recorded for a monitor do not count: drift is judged at the engine's own cadence."""
        return (
            self.layer_costs is not None
            and self.auto_plan
            and self.check_every > 0
            and flight.call % self.check_every == 0
            and flight.call >= self._plan_since
            and flight.schedule.plan == self.plan
        )

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

    def _set_plan(self, plan: StagePlan) -> None:
        """Switch plans between batches: each flight carries its own schedule, so nothing drains."""
        self.plan = plan
        self._reference, self._drifted, self._plan_since, self.drift = None, 0, self.calls, None
        self._first_uploads.clear()  # another first slot
        self.handoff = None
        self._predict()

    def _predict(self) -> None:
        """The simulator's bubble ratio for the current plan, measured layer costs and handoff."""
        if self.layer_costs is not None:
            self.predicted_bubble = simulate(
                "roundpipe-async" if self.asynchronous else "roundpipe-sync",
                self.layer_costs, self.num_workers, self.num_microbatches, plan=self.plan,
                handoff=self.handoff or 0.0,
            ).bubble_ratio  # fmt: skip

    # ------------------------------------------------------------------ one batch
    def train_batch(
        self,
        inputs: Any,
        target: Any,
        loss_fn: Callable[[Any, Any], Tensor],
        reduction: Reduction = "mean",
        grad_scale: float = 1.0,
        last_of_step: bool = False,
    ) -> Tensor:
        """Forward and backward of one batch; gradients of ``grad_scale * loss`` are added to the host
        store. Returns the batch loss (detached), as ``loss_fn`` would give on the whole batch.

        ``last_of_step`` (asynchronous mode): the caller promises that no further batch joins this
        optimizer step before :meth:`submit_step`. The step's batches are then known at once, and the
        previous update may be cast into each weight this step no longer uploads, during the step,
        instead of after it (edge 1 of :mod:`~lightning_roundpipe.runtime.optimizer_worker`). With one
        compute copy and a plan whose uploads all come early (one worker) that takes the cast off the
        critical path between steps. A batch after a promised last one is refused before it runs."""
        self._check_usable()
        if self.asynchronous and self._windows[self.step].closed.is_set():
            raise RuntimeError(
                f"a batch arrived for optimizer step {self.step} after the batch promised to be its last"
                " (train_batch(last_of_step=True)); call submit_step first, or pass last_of_step only on a"
                " step's last batch"
            )
        how = f"num_microbatches={self.microbatches_per_round} per round x num_rounds={self.num_rounds}"
        mb_inputs, mb_targets = split_batch(inputs, target, self.num_microbatches, how)
        weights = microbatch_weights(mb_targets, mb_inputs, reduction)
        if not any(weights) and not self._warned_empty:
            self._warned_empty = True
            warnings.warn(
                "a batch has nothing to average the loss over (the reduction counted 0 items); its loss is 0"
                " and it adds no gradient. Plain PyTorch would give NaN here.",
                stacklevel=2,
            )
        # staged first: a failure here (the host out of memory) must not leave a half-built flight behind
        staged = self._stage_all([*mb_targets, *mb_inputs])
        staged_targets, staged_inputs = staged[: len(mb_targets)], staged[len(mb_targets) :]
        flight = None
        try:  # until the flight owns the staged parcels, a failure (or Ctrl-C) gives them back here
            if not self.asynchronous:
                self.store.sync_compute()
            self._submitted = {c: t for c, t in self._submitted.items() if c >= self.calls - 8}
            self._submitted[self.calls] = now = time.perf_counter()
            if self._returned is not None:
                self._turns.append(now - self._returned)
                self._returned = None
            self._harvest()
            schedule = self.schedule(self.dispatch_position)
            if self.double_buffer == "first":
                self._spare_first_slot(schedule.plan)
            record = self._wants_record()
            self._record_next = False
            flight = Flight(
                self.calls, schedule, staged_targets, weights, grad_scale, loss_fn,
                self._abort, self.pool, self._grad_chain, self._slot_grad_groups(schedule.plan).__getitem__,
                self.store.fresh_grads, upload_waits=self._cast_done.get(self.step - 2), record=record,
                step=self.step, measure_memory=record and self._profile is not None,
            )  # fmt: skip
            if record:
                self._recording.append(flight)
            for m, parcel in enumerate(staged_inputs):
                flight.put(("act", 0, m), parcel)
        except BaseException:
            for parcel in (*staged_targets, *staged_inputs):
                self.pool.release(parcel)  # a parcel the flight already gave back holds no buffers
            if flight is not None:  # built, never dispatched: its gates in the gradient chain would never open
                if flight in self._recording:
                    self._recording.remove(flight)
                if not self.asynchronous:
                    self._recover(flight)
                else:
                    self._failed = True
            raise
        tasks = self._dispatch(flight, settle=not self.asynchronous)
        self.dispatch_position = schedule.next_first_worker
        self.calls += 1
        if self.asynchronous:
            window = self._windows[self.step]
            window.flights.append(flight)
            if last_of_step:
                window.closed.set()  # after the append: the optimizer thread reads the complete list
            try:
                loss = flight.wait_losses()
            except PipelineAborted:
                self._fail()
            self._prune()
            self._returned = time.perf_counter()
            return loss
        try:
            for task in tasks:
                task.done.wait()
        except BaseException as interrupt:  # e.g. KeyboardInterrupt in the main thread: stop the workers
            self._on_worker_error(interrupt)
            if all([task.done.wait(timeout=30.0) for task in tasks]):
                self._recover(flight)
            else:  # a worker still runs this batch: leave its buffers alone, and the engine unusable
                self._failed = True
            raise
        finally:
            self._prune()
        if self._error is not None:
            error = self._error
            self._recover(flight)
            raise error
        self._harvest(wait=True)
        loss = flight.batch_loss()
        self._returned = time.perf_counter()
        return loss

    def _spare_first_slot(self, plan: StagePlan) -> None:
        """Give the groups ``plan``'s first slot reads a spare copy, before a step's first batch.

        Only there: no batch of this step has chosen a copy yet. Update ``step - 1``'s cast decides
        after its math whether the group has a spare; deciding "yes" it writes the copy the step after
        next reads at once, which mid-step would be the copy this step's earlier batches still upload
        (a plan change in the middle of an accumulated step waits for the next step). A new spare
        starts as a copy of the compute copy, which must hold updates ``0..step-2``: wait for update
        ``step - 2``'s cast (it waits for the previous step's last upload of the group, so no earlier
        batch reads the group any more). It is pinned before it is published.
        """
        if self._windows[self.step].flights:
            return
        new = [g for g in self._slot_grad_groups(plan)[0] if self.store.groups[g].spare is None]
        if not new:
            return
        pending = self._cast_done.get(self.step - 2, {})
        try:
            for g in new:
                if g in pending:
                    pending[g].wait()
        except PipelineAborted:
            self._fail()
        self.store.add_spares(new, prepare=self.pool.register)

    # ------------------------------------------------------------------ forward-only passes
    def begin_evaluation(self) -> None:
        """Make the compute copies hold the masters, as plain training would evaluate them.

        Synchronous mode: refresh what the last optimizer step changed. Asynchronous mode: the masters
        hold the last update but the next training batch must still compute without it (staleness 1),
        so the compute copies of the groups with a pending cast are set aside and restored by
        :meth:`end_evaluation` (a transient extra 2 bytes per trainable parameter in bf16).
        """
        self._check_usable()
        self.flush()
        self._returned = None  # the host's turn between batches must not count this pass
        if not self.asynchronous:
            self.store.sync_compute()
            return
        self._settle_early_casts()
        if self._evaluation_stash is None:
            pending = self._cast_done.get(self.step - 1, {})
            self._evaluation_stash = {g: self.store.reads(g, self.step).clone() for g in pending}
            for g in pending:
                self.store.reads(g, self.step).copy_(self.store.groups[g].data)

    def end_evaluation(self) -> None:
        """Put back the compute copies :meth:`begin_evaluation` set aside."""
        stash, self._evaluation_stash = self._evaluation_stash, None
        for g, compute in (stash or {}).items():
            self.store.reads(g, self.step).copy_(compute)

    def evaluate(
        self,
        inputs: Any,
        target: Any = None,
        loss_fn: Callable[[Any, Any], Tensor] | None = None,
        reduction: Reduction = "mean",
    ) -> Any:
        """Forward only, through the pipeline: the batch loss (as ``loss_fn`` on the whole batch) or, with
        ``loss_fn=None``, the model's output with the micro-batches concatenated along dim 0.

        Nothing is kept for a backward pass and no gradient is touched; the training counters, seeds
        and dispatch position are left as they were. Wrap calls in :meth:`begin_evaluation` and
        :meth:`end_evaluation` (the strategy does) so the weights evaluated are the masters'.
        """
        self._check_usable()
        if not self.asynchronous:
            self.store.sync_compute()
        # a small batch (the last of a validation set) runs as fewer micro-batches, one round: nothing is
        # kept for backward, so the micro-batch count changes no number, only how the work is spread
        size = batch_size(inputs, "the inputs")
        per_round, rounds = self.microbatches_per_round, self.num_rounds
        if size < self.num_microbatches:
            per_round, rounds = size, 1
        how = f"num_microbatches={per_round} per round x num_rounds={rounds}"
        mb_inputs, mb_targets = split_batch(inputs, target, per_round * rounds, how)
        weights = microbatch_weights(mb_targets, mb_inputs, reduction) if loss_fn is not None else []
        key = (self.plan, self.dispatch_position, per_round, rounds)
        if key not in self._eval_schedules:
            compute_only = round_robin(
                self.plan, self.num_workers, per_round, rounds, self.dispatch_position, forward_only=True
            )
            schedule = add_transfers(compute_only, self.overlap)
            validate(schedule)
            self._eval_schedules[key] = schedule
        schedule = self._eval_schedules[key]
        # staged buffers go back to a pool the workers reuse: never let them be inference tensors
        # (trainer.validate/test/predict run under torch.inference_mode)
        with torch.inference_mode(False):
            n = len(mb_targets) if loss_fn is not None else 0
            parcels = self._stage_all([*mb_targets[:n], *mb_inputs])
            targets = parcels[:n] if loss_fn is not None else [Parcel(None)] * len(mb_inputs)
            staged = parcels[n:]
        self._eval_calls += 1
        flight = Flight(
            -self._eval_calls, schedule, targets, weights, 1.0, loss_fn, self._abort, self.pool, {},
            self._slot_grad_groups(schedule.plan).__getitem__, set(), evaluating=True, step=self.step,
        )  # fmt: skip
        for m, x in enumerate(staged):
            flight.put(("act", 0, m), x)
        tasks = self._dispatch(flight, settle=True)
        try:
            for task in tasks:
                task.done.wait()
        except BaseException as interrupt:
            self._on_worker_error(interrupt)
            if all([task.done.wait(timeout=30.0) for task in tasks]) and not self.asynchronous:
                flight.release_all()
                self._error = None  # ready again, as after a failed training batch
                self._abort.clear()
            else:
                self._failed = True
            raise
        finally:
            self._prune()
        if self._error is not None:
            if self.asynchronous:
                self._fail()
            flight.release_all()
            error, self._error = self._error, None
            self._abort.clear()
            raise error
        if loss_fn is not None:
            return flight.batch_loss()
        return _concatenate([self._take_output(p) for p in flight.losses])

    def _stage_all(self, trees: list[Any]) -> list[Parcel]:
        """Host copies of each tree for the workers; all or none (a failure gives back what it took)."""
        parcels: list[Parcel] = []
        try:
            for tree in trees:
                parcels.append(self.pool.stage(tree))
        except BaseException:
            for parcel in parcels:
                self.pool.release(parcel)
            raise
        return parcels

    def _dispatch(self, flight: Flight, settle: bool) -> list[Task]:
        """Hand each worker its actions of ``flight``'s schedule; the flight is live until they finish."""
        attributes = plain_attributes(self.layers)
        with self._error_lock:
            self._live.append((flight, []))
        tasks = self._live[-1][1]
        for w, executor in enumerate(self._executors):
            run = partial(executor.run, flight.schedule.workers[w], flight, attributes, settle=settle)
            tasks.append(self._pool.submit(w, run))
        return tasks

    def _take_output(self, parcel: Parcel | None) -> Any:
        assert parcel is not None
        if parcel.ready is not None:
            parcel.ready.synchronize()
        leaves, spec = tree_flatten(parcel.value)
        owned = tree_unflatten([t.clone() if isinstance(t, Tensor) else t for t in leaves], spec)
        self.pool.release(parcel)
        return owned

    # ------------------------------------------------------------------ asynchronous optimizer
    def submit_step(self, spec: UpdateSpec) -> None:
        """Hand the current step's update to the optimizer worker and start the next step."""
        if self._optimizer is None:
            raise RuntimeError("submit_step needs an engine built with asynchronous=True")
        self._check_usable()
        k = self.step
        window = self._windows[k]
        if not window.flights:
            return  # no batch ran in this step: nothing to update
        if self.consistency == "barrier":  # drain, then cast the previous update here, all groups at once
            self.flush()
            for g, gate in self._cast_done.get(k - 1, {}).items():
                self.store.refresh_group(g, k + 1)
                gate.set()
        grads_complete = {g: self._grad_chain[g] for g in self._trainable if g in self._grad_chain}
        order = tuple(sorted(grads_complete, key=lambda g: (-self.store.groups[g].layer, g)))  # deep first
        consumed = {g: self._job_gate() for g in order}
        cast_done = {g: self._job_gate() for g in order}
        self._grad_chain.update(consumed)  # the next step's first gradient writes wait for these
        self._cast_done[k] = cast_done
        self._cast_done.pop(k - 3, None)
        next_window = StepWindow(self._abort)
        self._windows[k + 1] = next_window
        self._windows.pop(k - 2, None)
        window.closed.set()
        self.store.fresh_grads = set(self._trainable)
        cast = self.consistency == "layerwise"
        self._optimizer.submit(
            UpdateJob(k, spec, order, grads_complete, consumed, cast_done, next_window, cast, window=window)
        )
        self.step += 1

    def flush(self) -> None:
        """Wait until every batch's gradients are collected and every submitted update reached the
        masters (checkpoints, validation and teardown need this). Casts for the next step may remain."""
        with self._error_lock:
            live = list(self._live)
        for _, tasks in live:
            for task in tasks:
                task.done.wait()
        for collector in self._collectors:
            collector.drain()
        if self._optimizer is not None:
            self._optimizer.wait_math()
        self._prune()
        if self._error is not None:
            self._fail()
        self._harvest(wait=True)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """What resuming exactly needs besides the weights and the optimizer's state: the batch and step
        counters (part of every random seed), the dispatch position, the plan and the costs it came from,
        and, in the asynchronous mode, the compute copies: the masters already hold the last submitted
        update, but the next batch must compute on the weights without it (staleness 1)."""
        self.flush()
        self._settle_early_casts()
        state: dict[str, Any] = {
            "calls": self.calls,
            "step": self.step,
            "dispatch_position": self.dispatch_position,
            "base_seed": self.base_seed,
            "plan": str(self.plan),
            "layer_costs": None if self.layer_costs is None else asdict(self.layer_costs),
            "drift_reference": self._reference,
            "drifted": self._drifted,
            "offset_checked": self._offset_checked,
            "profiling": self._profile is not None,
        }
        if self.asynchronous and self._cast_done.get(self.step - 1):
            stash = self._evaluation_stash or {}  # saved during validation: the copies set aside are the ones
            state["compute"] = {
                g: (stash[g] if g in stash else self.store.reads(g, self.step)).clone() for g in self._trainable
            }
        return state

    def _settle_early_casts(self) -> None:
        """After a batch announced as its step's last and before :meth:`submit_step` (an exception
        checkpoint, say), the previous update's casts are already under way: let them land, so that
        nothing reads or sets aside a half-written copy. The copies then hold that update, one update
        ahead of what a step boundary would save (a run resumed from here computes its first step on
        the newest weights)."""
        if self.asynchronous and self._windows[self.step].closed.is_set():
            try:
                for gate in self._cast_done.get(self.step - 1, {}).values():
                    gate.wait()
            except PipelineAborted:
                self._fail()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where :meth:`state_dict` left off; call on a new engine, before its first batch,
        after the masters (the module's parameters) were loaded."""
        if self.calls or self._live:
            raise RuntimeError("load the roundpipe engine state before the first batch")
        self.calls, self.step = int(state["calls"]), int(state["step"])
        self.dispatch_position = int(state["dispatch_position"]) % self.num_workers
        self.base_seed = int(state["base_seed"])
        for executor in self._executors:
            executor.base_seed = self.base_seed
        if self.auto_plan and state.get("layer_costs") is not None:
            self.layer_costs = LayerCosts(**{k: tuple(v) for k, v in state["layer_costs"].items()})
            plan = StagePlan.parse(state["plan"])
            profiling = state.get("profiling", plan == LayerProfile.plan(len(self.layers)))  # older: by plan
            if profiling:
                self.replan()  # saved while measuring again: measure anew
            elif plan.num_layers == len(self.layers):
                self._profile = None
                self._set_plan(plan)
                # the plan's own timing, so that a resumed run (another machine, say) is judged against it
                reference = state.get("drift_reference")
                if reference is not None and len(reference) == plan.num_slots:
                    self._reference, self._drifted = list(reference), int(state.get("drifted", 0))
            self._offset_checked = bool(state.get("offset_checked", False))
        self._windows = {self.step: StepWindow(self._abort)}
        compute = state.get("compute")
        if compute is None:
            return
        if not self.asynchronous or self._optimizer is None:
            raise ValueError(
                "this checkpoint was saved by the asynchronous optimizer with an update pending; resume it with"
                " RoundPipeStrategy(async_optimizer=True)"
            )
        if sorted(compute) != sorted(self._trainable):
            raise ValueError("the checkpoint's roundpipe state does not match this model's trainable layers")
        for g, tensor in compute.items():
            self.store.reads(g, self.step).copy_(tensor)
        # the saved update is in the masters; cast it once the first batch has uploaded each layer
        order = tuple(sorted(self._trainable, key=lambda g: (-self.store.groups[g].layer, g)))
        cast_done = {g: self._job_gate() for g in order}
        self._cast_done = {self.step - 1: cast_done}
        job = UpdateJob(self.step - 1, None, order, {}, {}, cast_done, self._windows[self.step])
        self._optimizer.submit(job)

    def _job_gate(self) -> Gate:
        gate = Gate(self._abort)
        self._job_gates.append(gate)
        if len(self._job_gates) > 8 * len(self._trainable) + 64:  # keep only recent ones
            self._job_gates = [g for g in self._job_gates if not g.is_set()]
        return gate

    # ------------------------------------------------------------------ failures
    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("this roundpipe engine was closed; set up a new one (a new Trainer.fit does)")
        if self._failed:
            raise RuntimeError("this roundpipe engine stopped after an error in a worker; set up a new one")
        if self.asynchronous and self._error is not None:
            self._fail()

    def _prune(self) -> None:
        with self._error_lock:
            self._live = [(f, tasks) for f, tasks in self._live if not all(t.done.is_set() for t in tasks)]

    def transferred_bytes(self) -> tuple[int, int]:
        """Bytes copied host-to-device and device-to-host by all workers so far."""
        return sum(d.bytes_up for d in self.devices), sum(d.bytes_down for d in self.devices)

    def _on_worker_error(self, error: BaseException) -> None:
        with self._error_lock:
            if self._error is None:
                self._error = error
            self._abort.set()
            for flight, _ in self._live:
                flight.open_all_gates()
            for gate in self._job_gates:
                gate.set()
            for window in self._windows.values():
                window.closed.set()

    def _fail(self) -> None:
        """Asynchronous mode: stop everything after an error and raise it; the engine is not reusable
        (an update may have been cut short), but the process is not stuck and no thread keeps running."""
        self._on_worker_error(RuntimeError("aborted"))
        with self._error_lock:
            live = list(self._live)
        for _, tasks in live:
            for task in tasks:
                task.done.wait(timeout=30.0)
        for collector in self._collectors:
            collector.drain()
        if self._optimizer is not None:
            self._optimizer.wait_all(timeout=30.0)
        self._failed = True
        error = self._error
        assert error is not None
        raise error

    def _recover(self, flight: Flight) -> None:
        """Synchronous mode, after a failed batch, once every worker stopped: drop its partial gradients
        and the host buffers it still holds, and be ready again. Host weights are never written by
        workers, so they are intact."""
        flight.release_all()
        self._error = None
        self._grad_chain.clear()
        self.store.clear_grads()
        self._abort.clear()

    def close(self) -> None:
        """Finish pending updates, stop every thread and unpin host memory; idempotent."""
        if self._closed:
            return
        try:
            if self.asynchronous and not self._failed and self._error is None:
                self.flush()
                self._windows[self.step].closed.set()  # no more batches: pending casts may proceed
                if self._optimizer is not None:
                    self._optimizer.wait_all(timeout=60.0)
        finally:
            self._closed = True
            if self._optimizer is not None and not self._optimizer.wait_all(timeout=0):
                self._on_worker_error(RuntimeError("closed"))
            stuck = self._pool.close()
            stuck += [f"roundpipe-collector-{i}" for i, c in enumerate(self._collectors) if not c.close()]
            if self._optimizer is not None and not self._optimizer.close():
                stuck.append("roundpipe-optimizer")
            for device in self.devices:
                device.synchronize()
            if stuck:
                warnings.warn(f"roundpipe threads did not stop in time: {stuck}", stacklevel=2)
            else:
                self.pool.close()


DOUBLE_BUFFERS = ("none", "first", "all")


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _caller_outside_package() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside this package (the user's
    code or Lightning's), however deep inside the engine it is raised."""
    frame, level = sys._getframe(1), 1  # the function that warns
    while frame is not None and frame.f_globals.get("__name__", "").startswith("lightning_roundpipe"):
        frame, level = frame.f_back, level + 1
    return level


def double_buffering(value: bool | str) -> str:
    """``double_buffer`` as one of :data:`DOUBLE_BUFFERS` (``True`` is ``"all"``, ``False`` ``"none"``)."""
    if value is True or value is False:
        return "all" if value else "none"
    if value not in DOUBLE_BUFFERS:
        raise ValueError(f"double_buffer={value!r} is not one of {DOUBLE_BUFFERS} (or True/False)")
    return str(value)


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
