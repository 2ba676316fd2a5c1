"""A flight: what the workers share while one batch passes through the pipeline.

Boundary activations and gradients travel as :class:`Parcel` objects (host tensors and the device
event after which they are valid) through mailboxes keyed like
:mod:`lightning_roundpipe.schedule.dataflow`. A reader takes a parcel, issues its upload, then
releases the key with the upload's event; after the last reader the host buffers go back to the pool,
to be reused once those uploads finished. So the host holds only the stage inputs still needed.
Gradient downloads are ordered per flat group by a chain of gates fixed when the flight is built.

A *guarded* flight can fail alone: a device running out of memory in one of its actions stops this
batch only (its own gates open, the engine's abort stays clear), and the engine runs it again
(:mod:`~lightning_roundpipe.engine.recovery`). For that the flight counts which of its gradient
writes landed on the host, so a second attempt neither adds a group twice nor leaves one out.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten

from lightning_roundpipe.runtime.compiles import compile_mark
from lightning_roundpipe.runtime.host_pool import HostPool, Parcel
from lightning_roundpipe.runtime.workers import EitherEvent, Gate
from lightning_roundpipe.schedule.dataflow import Key, consumer_counts
from lightning_roundpipe.schedule.dispatch import Schedule
from lightning_roundpipe.schedule.plan import StageKind


class _Mailbox:
    __slots__ = ("events", "gate", "readers", "value")

    def __init__(self, gate: Gate, readers: int) -> None:
        self.gate = gate
        self.readers = readers
        self.value: Parcel | None = None
        self.events: list[Any] = []


class Flight:
    """Shared state of one batch: micro-batches, loss weights, mailboxes, losses and gradient order."""

    def __init__(
        self,
        call: int,
        schedule: Schedule,
        targets: list[Parcel],
        weights: list[float],
        grad_scale: float,
        loss_fn: Callable[[Any, Any], Tensor] | None,
        abort: threading.Event,
        pool: HostPool,
        grad_chain: dict[int, Gate],
        groups_of_slot: Callable[[int], tuple[int, ...]],
        fresh_grads: set[int],
        upload_waits: dict[int, Gate] | None = None,
        record: bool = False,
        evaluating: bool = False,
        step: int = 0,
        measure_memory: bool = False,
        samples: int = 0,
        guarded: bool = False,
        skip: frozenset[int] = frozenset(),
        sample_elements: float = 0.0,
        microbatch_elements: list[int] | None = None,
    ) -> None:
        self.call = call
        self.samples = samples  # the batch's samples: its dim-0 size, or a flattened batch's sequences
        self.sample_elements = sample_elements  # input elements per sample (tokens, for a language model)
        self.microbatch_elements = microbatch_elements or []  # as split (a language model's differ in size)
        self.step = step
        """Optimizer step the batch belongs to: which compute copy it uploads (double buffering)."""
        self.evaluating = evaluating
        """A forward-only pass (validation, test, predict): no gradients, nothing saved for backward;
        the fused stage puts the loss, or the output when ``loss_fn`` is ``None``, under the losses."""
        self.schedule = schedule
        self.targets = targets
        self.weights = weights
        self.grad_scale = grad_scale
        self.loss_fn = loss_fn
        self._guard(abort, guarded, skip)
        self.pool = pool
        self.losses: list[Parcel | None] = [None] * len(targets)
        self._gates: list[Gate] = []
        self.loss_ready = [self.gate() for _ in targets]
        self.upload_waits = upload_waits or {}
        """Per trainable group, the cast the first upload of the group must wait for (edge 2)."""
        self.record = record
        """Record compute timings: per worker, (action, start, after forward, end, saved bytes) with
        timer points of that worker's device (``after forward`` is ``None`` for forward actions)."""
        self.records: dict[int, list[tuple[Any, ...]]] = {}
        self.measure_memory = measure_memory
        """Profiling on devices that can tell: record each action's peak memory in :attr:`memory`."""
        self.memory: list[tuple[Any, int]] = []
        """(action, bytes): a forward's peak, or a recompute and backward's peak beyond what autograd kept
        and the stage's gradients (its transient)."""
        self.boundary_bytes = 0
        """Recorded batches: the largest activation one micro-batch handed between two stages (bytes),
        what each boundary kept for backward holds on the host, per micro-batch."""
        self.compile_mark = compile_mark()  # torch.compile's, before it: moved after, it waited for a compile
        self.references: dict[int, tuple[Any, float]] = {}
        """Per worker, a timer point and the host clock when its job started (for timelines)."""
        self.cast_wait, self.first_upload_bytes = 0.0, 0
        """Recorded batches: host seconds the first slot's upload waited for its weights' casts; bytes it copied."""
        self.first_upload: list[Any] = []
        """Recorded batches: timer points before and after the upload of the first slot's weights, on
        the stream that copies them (what the next batch cannot prefetch: see ``handoff`` in
        :func:`~lightning_roundpipe.schedule.simulate.roundpipe`)."""
        self.worker_waits: dict[str, float] = {}
        """Host seconds the workers' threads spent blocked on this batch, by what they waited for
        (:meth:`waited`): while a thread waits it issues nothing, and a device with nothing queued idles."""
        self._lock = threading.Lock()
        counts = consumer_counts((a for _, a in schedule.actions()), schedule.plan)
        self._boxes = {key: _Mailbox(self.gate(), n) for key, n in counts.items()}
        self.grad_order: dict[tuple[int, int], tuple[list[Gate], Gate]] = {}
        """Per slot, the gates its gradient writes wait for (the previous writers') and the one it opens."""
        self.overwrite: dict[tuple[int, int], frozenset[int]] = {}
        """Per slot, the groups it is the first to write since the host gradients were cleared: their
        gradients are copied straight into the host buffer instead of added to it."""
        if not evaluating:
            self._join_gradient_chain(grad_chain, groups_of_slot, fresh_grads)
        self._count_uploads(groups_of_slot)

    def _guard(self, abort: threading.Event, guarded: bool, skip: frozenset[int]) -> None:
        self.guarded = guarded
        """Out of device memory, this batch alone stops (:meth:`fail`) and the engine runs it again."""
        self._faulted = threading.Event()
        self.abort = EitherEvent(abort, self._faulted) if guarded else abort
        """The engine's abort, or for a guarded flight either it or this flight's own :meth:`fail`."""
        self.fault: BaseException | None = None
        """The error that stopped this guarded flight alone; :attr:`fault_at` says where."""
        self.fault_at: tuple[Any, Any] = (None, None)
        """(action, device) of :attr:`fault`."""
        self.host_writes = HostWrites(skip)

    def _count_uploads(self, groups_of_slot: Callable[[int], tuple[int, ...]]) -> None:
        self._uploads_left: dict[int, int] = {}
        """Per trainable group, how many of this flight's uploads of it are still to be issued. Counted,
        not "the last in schedule order": slots prefetch their weights, so a later slot's upload on one
        worker can come before an earlier slot's on another."""
        for stage in self.schedule.stages() * self.schedule.num_rounds:
            for g in groups_of_slot(stage.slot):
                self._uploads_left[g] = self._uploads_left.get(g, 0) + 1
        self._uploaded = {g: (self.gate(), []) for g in self._uploads_left}
        """Per trainable group: open once every upload of it was issued, and their events."""

    def _join_gradient_chain(
        self, grad_chain: dict[int, Gate], groups_of_slot: Callable[[int], tuple[int, ...]], fresh_grads: set[int]
    ) -> None:
        """Order this flight's gradient writes after every earlier writer of each group, slot by slot in
        schedule order (a fixed order: sums are bit-identical run to run)."""
        for rnd in range(self.schedule.num_rounds):
            for stage in self.schedule.stages():
                if stage.kind is StageKind.FORWARD:
                    continue
                groups = self.host_writes.planned((rnd, stage.slot), groups_of_slot(stage.slot))
                done = self.gate()
                waits = [grad_chain[g] for g in groups if g in grad_chain]
                self.grad_order[(rnd, stage.slot)] = (waits, done)
                self.overwrite[(rnd, stage.slot)] = frozenset(g for g in groups if g in fresh_grads)
                fresh_grads.difference_update(groups)
                for g in groups:
                    grad_chain[g] = done

    def waited(self, reason: str, since: float) -> None:
        """A worker thread was blocked from ``since`` (``time.perf_counter``) until now, waiting for
        ``reason``: "casts" (an update's cast into the weights it uploads, edge 2), "update reads" (an
        update reading the gradients it overwrites, edge 4), "earlier writes" (the host sums a tail slot
        adds to), "inputs" (a boundary from another stage), "inflight" (its own queued kernels), "launch"
        (the main thread's next batch), "host adds" (room at its collector for staged gradients)."""
        seconds = time.perf_counter() - since
        with self._lock:
            self.worker_waits[reason] = self.worker_waits.get(reason, 0.0) + seconds

    def gate(self) -> Gate:
        """A gate that an abort of this flight opens."""
        gate = Gate(self.abort)
        self._gates.append(gate)
        return gate

    def put(self, key: Key, parcel: Parcel | None) -> None:
        """Publish a key's value; ``None`` for a gradient means zero (nothing reaches the loss)."""
        box = self._boxes.get(key)
        if box is None:  # nobody reads it in this schedule
            if parcel is not None:
                self.pool.release(parcel)
            return
        if self.record and parcel is not None and key[0] == "act" and key[1] > 0:
            nbytes = sum(t.nbytes for t in tree_flatten(parcel.value)[0] if isinstance(t, Tensor))
            self.boundary_bytes = max(self.boundary_bytes, nbytes)  # a race loses a size seen twice: harmless
        box.value = parcel
        box.gate.set()

    def take(self, key: Key) -> Parcel | None:
        """Wait for ``key``; the caller must :meth:`release` it once its upload is issued."""
        box = self._boxes[key]
        box.gate.wait()
        return box.value

    def release(self, key: Key, event: Any = None) -> None:
        """One reader is done with ``key`` once ``event`` completes; the last one frees the buffers."""
        box = self._boxes[key]
        with self._lock:
            box.readers -= 1
            box.events.append(event)
            if box.readers > 0:
                return
            parcel, events = box.value, box.events
            box.value, box.events = None, []
        if parcel is not None:
            self.pool.release(parcel, events)

    def mark_uploaded(self, group: int, event: Any) -> None:
        """One of this flight's uploads of ``group`` was issued; it is done once ``event`` completes.
        After the last of them the cast of the next update may overwrite the copy (edge 1)."""
        gate, events = self._uploaded[group]
        with self._lock:
            events.append(event)
            self._uploads_left[group] -= 1
            last = self._uploads_left[group] == 0
        if last:
            gate.set()

    def wait_uploaded(self, group: int) -> None:
        """Wait until this flight no longer reads ``group``'s compute copy (or never will)."""
        if group not in self._uploaded:
            return
        gate, events = self._uploaded[group]
        gate.wait()
        for event in events:
            if event is not None:
                event.synchronize()

    def set_loss(self, microbatch: int, parcel: Parcel) -> None:
        self.losses[microbatch] = parcel
        self.loss_ready[microbatch].set()

    def wait_losses(self) -> Tensor:
        """The batch loss, as soon as every micro-batch's loss is on the host."""
        for gate in self.loss_ready:
            gate.wait()
        for parcel in self.losses:
            if parcel is not None and parcel.ready is not None:
                parcel.ready.synchronize()
        return self.batch_loss()

    def release_all(self) -> None:
        """After an aborted batch, once no worker runs it: give back every host buffer it still holds
        (values nobody finished reading, targets, losses), each after the copies known to touch it. A
        buffer released twice is given back once: a parcel drops its buffers as it is released."""
        for box in self._boxes.values():
            with self._lock:
                parcel, events = box.value, box.events
                box.value, box.events = None, []
            if parcel is not None:
                self.pool.release(parcel, [*events, parcel.ready])
        for parcel in (*self.targets, *self.losses):
            if parcel is not None:
                self.pool.release(parcel, [parcel.ready])

    # ------------------------------------------------------------------ failing alone (guarded flights)
    def recovers_from(self, error: BaseException) -> bool:
        """Whether ``error`` stops only this batch: a guarded flight's device out of memory."""
        return self.guarded and isinstance(error, torch.OutOfMemoryError)

    def fail(self, error: BaseException, action: Any, device: Any) -> None:
        """Stop this batch alone: every thread waiting on it wakes and stops; the first error is kept.
        Its frames' locals are dropped (they hold the device tensors the next attempt needs room for)."""
        with self._lock:
            if self.fault is None:
                traceback.clear_frames(error.__traceback__)
                self.fault, self.fault_at = error, (action, device)
        self._faulted.set()
        self.open_all_gates()

    def open_all_gates(self) -> None:
        """After an abort: wake every thread waiting on this flight."""
        for gate in self._gates:
            gate.force()

    def batch_loss(self) -> Tensor:
        """Sum of the weighted micro-batch losses in micro-batch order: the loss of the whole batch.

        Read after every worker synchronized its device, so the downloaded values are there.
        """
        missing = [m for m, loss in enumerate(self.losses) if loss is None]
        if missing:
            schedule = self.schedule
            raise RuntimeError(
                f"internal error: no loss for micro-batches {missing} of {len(self.losses)} (batch {self.call},"
                f" scheduled {schedule.microbatches_per_round} per round x {schedule.num_rounds} rounds on plan"
                f" {schedule.plan}, guarded {self.guarded}, writes skipped {sorted(self.host_writes.skip)})"
            )
        total = torch.zeros((), dtype=torch.float32)
        for parcel in self.losses:
            assert parcel is not None
            total = total + parcel.value.float()
            self.pool.release(parcel)
        return total


class HostWrites:
    """Which of a flight's gradient writes reached the host for good: what the next attempt of a batch
    that failed needs, so that it neither adds a group twice nor leaves one out."""

    def __init__(self, skip: frozenset[int] = frozenset()) -> None:
        self.skip = skip
        """Trainable groups whose gradients an earlier attempt of this batch already put on the host."""
        self.by_slot: dict[tuple[int, int], tuple[int, ...]] = {}
        """Per slot, the trainable groups whose gradients it writes to the host."""
        self.expected: dict[int, int] = {}
        """Per group, how many gradient writes the flight makes (one per round)."""
        self.landed: dict[int, int] = {}
        """Per group, how many of them are on the host."""
        self.summing: dict[tuple[int, int], tuple[int, ...]] = {}
        """Per slot whose gradients a device is summing into the host's, its groups until its job landed:
        a batch stopped there leaves those host gradients half summed."""
        self._lock = threading.Lock()

    def planned(self, key: tuple[int, int], groups: tuple[int, ...]) -> tuple[int, ...]:
        """Slot ``key`` will write ``groups`` (those not skipped, which it returns)."""
        self.by_slot[key] = tuple(g for g in groups if g not in self.skip)
        for g in self.by_slot[key]:
            self.expected[g] = self.expected.get(g, 0) + 1
        return self.by_slot[key]

    def slot_landed(self, key: tuple[int, int]) -> None:
        """The gradient writes of slot ``key`` are on the host (the collector calls this)."""
        with self._lock:
            self.summing.pop(key, None)
            for g in self.by_slot.get(key, ()):
                self.landed[g] = self.landed.get(g, 0) + 1

    def groups_landed(self, key: tuple[int, int], groups: Any) -> None:
        """Of slot ``key``'s writes, those of ``groups`` are there for good already (a device's own gradients,
        with a share of the states there); :meth:`slot_landed` counts the rest."""
        with self._lock:
            mine = self.by_slot.get(key, ())
            for g in mine:
                if g in groups:
                    self.landed[g] = self.landed.get(g, 0) + 1
            self.by_slot[key] = tuple(g for g in mine if g not in groups)

    def complete(self, rounds: int) -> tuple[set[int], str | None]:
        """Once no thread runs the flight: the groups whose writes all landed, and why another attempt
        could not be exact (``None`` if it can): a group with some but not all of its ``rounds`` writes
        on the host, or one half summed by a device."""
        if self.summing:
            groups = sorted({g for groups in self.summing.values() for g in groups})
            return set(), f"the gradients of groups {groups} were being summed into the host's when it stopped"
        partial = sorted(g for g, n in self.landed.items() if n < self.expected[g])
        if partial:
            return set(), f"groups {partial} had some but not all of their {rounds} rounds' gradients on the host"
        return set(self.landed), None
