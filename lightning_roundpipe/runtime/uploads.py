"""Weight uploads: the ``LOAD`` action, and the slot's device tensors its compute reads.

Uploads run on the parameters-up stream, in the parts the schedule placed between compute actions.
A slot's first part waits for the cast of the update it must read (edge 2 of docs/architecture.md);
its last marks the groups uploaded, so the next cast may overwrite them after the flight's last
upload (edge 1).
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from lightning_roundpipe.runtime.flight import Flight
from lightning_roundpipe.runtime.slots import LoadedSlot, WorkerSlots
from lightning_roundpipe.schedule.actions import Action
from lightning_roundpipe.schedule.plan import Stage


class WeightUploads:
    """Copies a slot's weights from the host store onto the worker's device."""

    def __init__(self, slots: WorkerSlots, overlap: str) -> None:
        self.slots = slots
        self.device = slots.device
        self.store = slots.store
        self.overlap = overlap

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
            if handoff:
                flight.cast_wait = time.perf_counter() - waiting
                flight.first_upload.append(dev.timer(dev.param_up))
            groups, resident = self.store.groups, None if flight.evaluating else self.slots.resident
            self.slots.loaded[key] = LoadedSlot(
                {  # a resident group's slot tensor is the device's copy for the step: nothing to upload
                    g: resident.reads(g, flight.step)
                    if resident is not None and g in resident.held
                    else dev.empty(groups[g].compute.numel(), groups[g].compute.dtype, dev.param_up)
                    for g in self.slots.groups[stage.slot]
                }
            )
            if handoff:  # what this slot's upload copies, for the upload rate (a resident group's: nothing)
                copied = [g for g in self.slots.groups[stage.slot] if resident is None or g not in resident.held]
                flight.first_upload_bytes = sum(groups[g].compute.nbytes for g in copied)
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
