"""Weight uploads: the ``LOAD`` action, and the slot's device tensors its compute reads.

Uploads run on the parameters-up stream, in the parts the schedule placed between compute actions.
A slot's first part waits for the cast of the update it must read (edge 2 of docs/architecture.md);
its last marks the groups uploaded, so the next cast may overwrite them after the flight's last
upload (edge 1).

Where the buffers come from: torch's caching allocator keeps a pool per stream, and a freed block serves
only its own stream, so buffers taken on the parameters-up stream sat beside the compute stream's pool
and the card held about the sum of both pools' highs (at 24 GiB and 8 varied sequences a step: 15.2 GiB
of compute's and 5.3 of the uploads' against 15.0 in use at torch's peak, 2026-12-07). The buffers now
come from the compute stream's pool, taken before the compute their upload overlaps is issued
(:func:`reservations`; the next batch's first upload's before this batch's last run): the upload waits, on
the device, for the compute issued before that point, which covers every earlier use of the blocks, and
the prefetch behind the run before is kept. A batch whose first upload finds no buffers taken ahead (the
first, one after a validation, a plan change or a batch that settled) takes them at its start, after all
the compute issued before. A run's weights go back after its last compute, so that the next run's are not
taken beside them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_roundpipe.runtime.flight import Flight
from lightning_roundpipe.runtime.slots import LoadedSlot, WorkerSlots
from lightning_roundpipe.schedule.actions import Action, Op
from lightning_roundpipe.schedule.plan import Stage


class WeightUploads:
    """Copies a slot's weights from the host store onto the worker's device."""

    from_compute_pool = True
    """Take the weights' device buffers from the compute stream's pool (off: the parameters-up stream's, as before
    2026-12-07; see the module docstring)."""
    take_ahead = True
    """Take the buffers of the next batch's first upload before this batch's last run (off: taken when it starts,
    ordered after every compute issued before it)."""

    def __init__(self, slots: WorkerSlots, overlap: str) -> None:
        self.slots = slots
        self.device = slots.device
        self.store = slots.store
        self.overlap = overlap
        self.reserve_at: dict[int, list[Action]] = {}
        """Per index in the batch's actions, the uploads whose buffers are taken just before that action."""
        self.early: set[tuple[int, int]] = set()
        """The batch's slots whose upload starts before its first compute."""
        self.release_at: dict[int, tuple[int, int]] = {}
        """Per index of a run's last compute, its slot, whose weights no later action reads."""
        self.ahead_at: int | None = None
        """Index of the batch's last run's first action, before which the next batch's first buffers are taken."""
        self.ahead: tuple[dict[int, Tensor], Any] | None = None
        """The next batch's first upload's buffers, taken in this batch, and the compute event they wait for."""
        self._worker = 0

    def begin(self, actions: Sequence[Action], flight: Flight, settle: bool) -> None:
        """Where this batch's buffers come from (see the module docstring). A batch that settles takes none ahead:
        the next one's first upload cannot overlap it."""
        on = self.from_compute_pool and self.overlap == "priority"
        openers = run_openers(actions)
        self.reserve_at = reservations(actions) if on else {}
        self.early = {(a.round, a.slot) for a in actions[: openers[0] if openers else None] if a.op is Op.LOAD}
        last = {(a.round, a.slot): i for i, a in enumerate(actions) if a.op.is_compute}  # each run's last compute
        self.release_at = {i: key for key, i in last.items()} if self.from_compute_pool else {}
        ahead = on and self.take_ahead and openers and not flight.evaluating and not settle
        self.ahead_at = openers[-1] if ahead else None
        first = next((a for a in actions if a.op is Op.LOAD), None)
        self._worker = flight.schedule.worker_of(first.round, first.slot) if first is not None else 0

    def reserve(self, load: Action, flight: Flight) -> None:
        """Take the buffers of ``load``'s upload, which starts inside the run about to be issued."""
        self.slots.loaded[(load.round, load.slot)] = self._from_compute(load.slot, flight)

    def reserve_ahead(self, flight: Flight) -> None:
        """Before the batch's last run: the buffers of the next batch's first upload here, if the plan and dispatch
        stay. Best effort: where they do not fit now, that upload takes its own when it starts."""
        dev, slot = self.device, next_first_slot(self._worker, flight.schedule)
        self.ahead = None
        if slot is not None:
            with contextlib.suppress(torch.OutOfMemoryError):
                self.ahead = (self._buffers(slot, flight, dev.compute), dev.record(dev.compute))

    def computed(self, index: int) -> None:
        """After a run's last compute: its weights go back to the pool now, not at the slot's unload; the next
        run's are taken before it opens, and would otherwise sit beside these and this run's own. Only compute's
        later work gets the blocks back, after its reads (:meth:`WorkerSlots.release`)."""
        key = self.release_at.get(index)
        if key is not None and key in self.slots.loaded:
            self.slots.release(key)

    def _buffers(self, slot: int, flight: Flight, stream: Any) -> dict[int, Tensor]:
        """New device buffers, from ``stream``'s pool, for the groups the slot's upload copies."""
        groups = self.store.groups
        copied = self._copied(slot, flight)
        return {g: self.device.empty(groups[g].compute.numel(), groups[g].compute.dtype, stream) for g in copied}

    def _copied(self, slot: int, flight: Flight) -> list[int]:
        """The groups a slot's upload copies: a resident group's slot tensor is the device's copy for the step."""
        resident = None if flight.evaluating else self.slots.resident
        return [g for g in self.slots.groups[slot] if resident is None or g not in resident.held]

    def _slot(self, slot: int, flight: Flight, buffers: dict[int, Tensor], taken: Any) -> LoadedSlot:
        resident = None if flight.evaluating else self.slots.resident
        flats = {g: buffers[g] if g in buffers else resident.reads(g, flight.step) for g in self.slots.groups[slot]}
        return LoadedSlot(flats, taken=taken)

    def _take(self, key: tuple[int, int], flight: Flight) -> LoadedSlot:
        """The slot's device tensors where :meth:`reserve` took none: the batch's first upload's were taken ahead
        in the batch before if the plan and dispatch stayed; else from compute's pool now, ordered after all the
        compute issued so far (the first batch, the placements other than ``"priority"``)."""
        dev, slot = self.device, key[1]
        ahead, self.ahead = self.ahead, None
        if ahead is not None and key in self.early and set(ahead[0]) == set(self._copied(slot, flight)):
            return self._slot(slot, flight, *ahead)
        if not self.from_compute_pool:
            return self._slot(slot, flight, self._buffers(slot, flight, dev.param_up), None)
        return self._from_compute(slot, flight)

    def _from_compute(self, slot: int, flight: Flight) -> LoadedSlot:
        """New buffers from the compute stream's pool, with the event on it their upload waits for."""
        buffers = self._buffers(slot, flight, self.device.compute)
        return self._slot(slot, flight, buffers, self.device.record(self.device.compute))

    def load(self, stage: Stage, action: Action, flight: Flight) -> None:
        dev = self.device
        key = (action.round, action.slot)
        handoff = flight.record and key == (0, 0)  # measured for the simulator's handoff between batches
        if action.is_first_part:
            waiting = time.perf_counter()
            for g in self.slots.trainable[stage.slot]:  # edge 2: the copy this step must read is in place
                gate = flight.upload_waits.get(g)
                if gate is not None:
                    gate.wait()
            flight.waited("casts", waiting)
            if self.overlap == "none":  # no prefetch: upload only once the device finished computing
                dev.wait(dev.param_up, dev.record(dev.compute))
            if key not in self.slots.loaded:
                self.slots.loaded[key] = self._take(key, flight)
            dev.wait(dev.param_up, self.slots.loaded[key].taken)  # compute's earlier uses of the blocks are done
            if handoff:
                flight.cast_wait = time.perf_counter() - waiting
                flight.first_upload.append(dev.timer(dev.param_up))
                # what this slot's upload copies, for the upload rate (a resident group's: nothing)
                groups = self.store.groups
                flight.first_upload_bytes = sum(groups[g].compute.nbytes for g in self._copied(stage.slot, flight))
        loaded = self.slots.loaded[key]
        resident = None if flight.evaluating else self.slots.resident
        for g, start, stop in self.slots.parts(stage.slot, "W", action.parts)[action.part]:
            if resident is not None and g in resident.held:
                continue
            source = self.store.reads(g, flight.step)
            dev.copy_up(loaded.flats[g][start:stop], source[start:stop], dev.param_up)
        if action.is_last_part:
            loaded.ready = dev.record(dev.param_up)
            if handoff:
                flight.first_upload.append(dev.timer(dev.param_up))
            for g in self.slots.trainable[stage.slot]:  # edge 1: after the flight's last, the cast may overwrite
                flight.mark_uploaded(g, loaded.ready)


def next_first_slot(worker: int, schedule: Any) -> int | None:
    """The slot ``worker`` runs first in the batch after ``schedule``'s if plan, counts and dispatch stay (slot ``s``
    of round ``r`` runs on worker ``(first + r * slots + s) mod workers``); ``None``: it runs none."""
    slots, workers = schedule.plan.num_slots, schedule.num_workers
    for r in range(schedule.num_rounds):
        slot = (worker - schedule.next_first_worker - r * slots) % workers
        if slot < slots:
            return slot
    return None


def run_openers(actions: Sequence[Action]) -> list[int]:
    """Indices of the compute actions that open a slot's run (its first micro-batch on this worker)."""
    out, run = [], None
    for i, action in enumerate(actions):
        if action.op.is_compute and (action.round, action.slot) != run:
            out.append(i)
            run = (action.round, action.slot)
    return out


def reservations(actions: Sequence[Action]) -> dict[int, list[Action]]:
    """Per index of a compute action that opens a slot's run, the uploads (first parts) that start after it in the
    list (before the next run opens): with the ``"priority"`` placement, the next slot's upload overlaps this
    run, so its buffers are taken from the compute stream's pool just before the run is issued. Uploads that no
    compute precedes are not in it."""
    out: dict[int, list[Action]] = {}
    opener, run = None, None
    for i, action in enumerate(actions):
        if action.op.is_compute and (action.round, action.slot) != run:
            opener, run = i, (action.round, action.slot)
        elif action.op is Op.LOAD and action.is_first_part and opener is not None:
            out.setdefault(opener, []).append(action)
    return out


def slot_tensors(
    slots: WorkerSlots, stage: Stage, action: Action, gradients: bool = True
) -> dict[int, dict[str, Tensor]]:
    """The slot's named device tensors per layer, with the compute stream ordered after their upload.

    Built once per slot. In stages with gradients every trainable parameter is its own leaf
    whose ``.grad`` is preset to a view of a zeroed flat buffer, so autograd accumulates there in
    place over the micro-batches, and the download is one flat copy per group. (Views of one
    flat leaf would make autograd build a full-size zero tensor per parameter per backward.)
    """
    loaded = slots.loaded[(action.round, action.slot)]
    if loaded.tensors is not None:
        return loaded.tensors
    dev = slots.device
    dev.wait(dev.compute, loaded.ready)
    for g, flat in loaded.flats.items():
        dev.keep_alive(flat, dev.compute)
        if gradients and stage.has_gradients and slots.store.groups[g].trainable:
            loaded.grads[g] = torch.zeros_like(flat)
    leaves: dict[tuple[int, int], Tensor] = {}
    loaded.tensors = {}
    for i in stage.layers:
        named = {}
        for ref in slots.store.layer_tensors[i]:
            key = (ref.group, ref.offset)
            if key not in leaves:
                # each tensor with a version counter of its own, as a module's parameters have: an in-place
                # write to one (peft's LoRA on parameters re-sets the expert weights) must not look to
                # autograd like a change of another tensor that shares the flat buffer
                view = loaded.flats[ref.group].data[ref.offset : ref.offset + ref.numel].view(ref.shape)
                if ref.group in loaded.grads:
                    view = view.detach().requires_grad_(True)
                    view.grad = loaded.grads[ref.group][ref.offset : ref.offset + ref.numel].view(ref.shape)
                leaves[key] = view
            named[ref.name] = leaves[key]
        loaded.tensors[i] = named
    return loaded.tensors
