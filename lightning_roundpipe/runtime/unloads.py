"""Gradient unloads: the ``UNLOAD`` action, which frees a slot and downloads its gradients.

Downloads run on the gradients-down stream, in the parts the schedule placed between compute actions.
A group's first write since the host gradients were cleared goes straight into the host gradient; later
writes go into staging buffers the worker's collector adds on the host, except in the tail slot of a
settling batch, which sums them on the device (:func:`tail_slot`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from torch import Tensor

from lightning_roundpipe.runtime.collector import GradCollector, GradJob
from lightning_roundpipe.runtime.flight import Flight
from lightning_roundpipe.runtime.slots import WorkerSlots
from lightning_roundpipe.runtime.workers import Gate
from lightning_roundpipe.schedule.actions import Action, Op
from lightning_roundpipe.schedule.plan import Stage


class GradientUnloads:
    """Hands a slot's gradients to the host: downloads, on-device sums, and the collector's jobs."""

    _CONVERT_CHUNK = 1 << 24  # elements converted at a time before a download (64 MiB in fp32)

    def __init__(self, slots: WorkerSlots, collector: GradCollector, overlap: str) -> None:
        self.slots = slots
        self.device = slots.device
        self.store = slots.store
        self.collector = collector
        self.overlap = overlap
        self.collecting: list[Gate] = []
        """Per gradient unload of the batch, the gate the collector opens once its gradients are on the host."""
        self.tail: tuple[int, int] | None = None
        """The slot whose gradients a settling batch downloads last on this worker: no compute follows
        it to hide a host add, so its later writes are summed on the device instead."""
        self.staging_cap: int | None = None
        """In a settling batch, the most staging bytes that may wait for the collector (it waits for the
        collector at its end anyway): later writes wait for room (:meth:`GradCollector.room`)."""

    def unload(self, stage: Stage, action: Action, flight: Flight) -> None:
        dev = self.device
        key = (action.round, action.slot)
        loaded = self.slots.loaded[key]
        if not stage.has_gradients or flight.evaluating:
            if action.is_last_part:
                self.slots.drop(key)  # (its weights went back after the run's last compute)
            return
        resident = self.slots.resident
        if resident is not None and resident.whole:
            return self._into_resident(stage, action, flight, loaded, key)
        held = frozenset() if resident is None else resident.held.intersection(self.slots.trainable[stage.slot])
        waits, done = flight.grad_order[key]
        overwrite = flight.overwrite[key]
        if action.is_first_part and held:  # a share of the states on the device: those groups' gradients there
            self._write_resident(held, flight, loaded, key)
        if action.is_first_part and loaded.backward_ran:
            dev.wait(dev.grad_down, loaded.last_compute)
            skip = flight.host_writes.skip
            grads = {g: grad for g, grad in loaded.grads.items() if g not in skip and g not in held}
            if any(g in overwrite for g in grads):
                waiting = time.perf_counter()
                for gate in waits:  # edge 4: the previous step's update has read the gradients
                    gate.wait()
                flight.waited("update reads", waiting)
            # The tail slot sums its later writes on the device once the host sums are complete. No
            # compute is left for this worker to issue in this batch, so the wait delays no kernel.
            summed_here = key == self.tail
            if summed_here and any(g not in overwrite for g in grads):
                waiting = time.perf_counter()
                for gate in waits:  # the previous writers (edge 4 too, where it is one of them)
                    gate.wait()
                flight.waited("earlier writes", waiting)
                flight.host_writes.summing[key] = tuple(g for g in grads if g not in overwrite)
            if self.staging_cap is not None and not summed_here:  # a settling batch: no faster than the host adds
                staged = sum(grad.nbytes for g, grad in grads.items() if g not in overwrite)
                if staged:
                    waiting = time.perf_counter()
                    self.collector.room(staged, self.staging_cap, flight.abort)
                    flight.waited("host adds", waiting)
            for g, grad in grads.items():
                host = self.store.groups[g].grad
                assert host is not None
                if g in overwrite:  # first write since cleared: straight into the host gradient
                    loaded.downloads[g] = (grad, host)
                elif summed_here:
                    loaded.summed_here.add(g)
                    loaded.downloads[g] = (grad, host)
                else:
                    loaded.staging[g] = dev.pool.take(grad.numel(), grad.dtype)
                    loaded.downloads[g] = (grad, loaded.staging[g])
        for g, start, stop in self.slots.parts(stage.slot, "G", action.parts)[action.part]:
            if g in loaded.downloads:
                source, destination = loaded.downloads[g]
                if g in loaded.summed_here:
                    self._add_on_device(source, destination, start, stop)
                else:
                    self._download_range(source, destination, start, stop)
        if action.is_last_part:
            copied = dev.record(dev.grad_down)
            for source, _ in loaded.downloads.values():
                dev.keep_alive(source, dev.grad_down)
            unwritten = [] if loaded.backward_ran else sorted(set(overwrite) - held)  # no gradient reached them
            self.slots.drop(key)  # from here the collector owns its staging buffers
            landed = partial(flight.host_writes.slot_landed, key)
            self.collector.submit(GradJob(loaded.staging, copied, waits, done, unwritten, landed))
            self.collecting.append(done)
            if self.overlap == "none":  # no overlap: compute waits for the download
                dev.wait(dev.compute, copied)

    def _into_resident(self, stage: Stage, action: Action, flight: Flight, loaded: Any, key: tuple[int, int]) -> None:
        """``optimizer_on="device"``: the slot's gradients go into the groups' device gradients on the
        gradients-down stream after everything the slot computed (its reads of the copies included); they are
        there for good once queued (the next attempt of a failed batch skips them), and the collector opens the
        slot's gate once the device did them."""
        dev = self.device
        waits, done = flight.grad_order[key]
        if action.is_first_part:
            self._write_resident(self.slots.trainable[stage.slot], flight, loaded, key)
        if action.is_last_part:
            copied = dev.record(dev.grad_down)
            self.slots.drop(key)
            self.collector.submit(GradJob({}, copied, waits, done))
            self.collecting.append(done)
            if self.overlap == "none":
                dev.wait(dev.compute, copied)

    def _write_resident(self, groups: Any, flight: Flight, loaded: Any, key: tuple[int, int]) -> None:
        """The slot's gradients of ``groups`` into their device gradients, on the gradients-down stream after the
        slot's compute; there for good once queued."""
        dev, resident = self.device, self.slots.resident
        assert resident is not None
        overwrite = flight.overwrite[key]
        groups = [g for g in groups if g not in flight.host_writes.skip]
        if any(g in overwrite for g in groups):
            waiting = time.perf_counter()
            for gate in flight.grad_order[key][0]:  # edge 4: the previous step's update has read the gradients
                gate.wait()
            flight.waited("update reads", waiting)
        dev.wait(dev.grad_down, loaded.last_compute if loaded.backward_ran else dev.record(dev.compute))
        with dev.on(dev.grad_down):
            for g in groups:
                grad = loaded.grads.get(g) if loaded.backward_ran else None
                resident.write_gradient(g, grad, g in overwrite)
                if grad is not None:
                    dev.keep_alive(grad, dev.grad_down)
        resident.written(groups, dev.record(dev.grad_down))
        flight.host_writes.groups_landed(key, groups)

    def _add_on_device(self, source: Tensor, host: Tensor, start: int, stop: int) -> None:
        """``host[start:stop] += source[start:stop]``, summed on the device: the host's partial sum goes
        up in chunks through two device buffers, each chunk gets the device gradient added and comes
        back over the old values. Measured on one H200: the tied embedding's second write (311 M
        elements) took 123 ms to add on the host (2.5 G elements/s) after the last compute of a step, with
        nothing left to hide it; this moves 1.2 GB each way instead, both directions at once. The
        additions are the collector's (fp32 ``a + b`` is ``b + a``), so sums stay bit-identical."""
        dev = self.device
        size = min(self._CONVERT_CHUNK, stop - start)
        # Allocated on the stream that first writes them: a block freed on the gradients-down stream with
        # its download still queued (a converted chunk of the slot before) is not reused until that stream
        # is past it, and ``keep_alive`` below covers the adds and downloads that come after.
        buffers = [dev.empty(size, host.dtype, dev.param_up) for _ in range(2)]
        came_down: list[Any] = [None, None]
        for i, a in enumerate(range(start, stop, self._CONVERT_CHUNK)):
            b = min(stop, a + self._CONVERT_CHUNK)
            buffer = buffers[i % 2][: b - a]
            dev.wait(dev.param_up, came_down[i % 2])  # the chunk before last has left this buffer
            dev.copy_up(buffer, host[a:b], dev.param_up)
            dev.wait(dev.grad_down, dev.record(dev.param_up))
            with dev.on(dev.grad_down):
                buffer.add_(source[a:b])
            dev.copy_down(host[a:b], buffer, dev.grad_down)
            came_down[i % 2] = dev.record(dev.grad_down)
        for buffer in buffers:
            dev.keep_alive(buffer, dev.grad_down)

    def _download_range(self, source: Tensor, destination: Tensor, start: int, stop: int) -> None:
        """Copy ``source[start:stop]`` into host ``destination``; a dtype change (bf16 gradients into
        the fp32 host buffer) happens on the device in bounded chunks, never for the whole group."""
        dev = self.device
        if source.dtype == destination.dtype:
            dev.copy_down(destination[start:stop], source[start:stop], dev.grad_down)
            return
        for a in range(start, stop, self._CONVERT_CHUNK):
            b = min(stop, a + self._CONVERT_CHUNK)
            with dev.on(dev.grad_down):
                converted = source[a:b].to(destination.dtype)
            dev.copy_down(destination[a:b], converted, dev.grad_down)
            dev.keep_alive(converted, dev.grad_down)


def tail_slot(actions: Sequence[Action], downloads: Callable[[int], bool]) -> tuple[int, int] | None:
    """(round, slot) of the last slot whose unload in this worker's ``actions`` downloads gradients
    (``downloads(slot)``: a stage with gradients and trainable groups), if no compute follows the start
    of that unload: then nothing is left to hide a host add behind. ``None`` otherwise (a later
    round's forward stage may come after it)."""
    last_compute = max((i for i, a in enumerate(actions) if a.op.is_compute), default=-1)
    for i in range(len(actions) - 1, -1, -1):
        a = actions[i]
        if a.op is Op.UNLOAD and a.is_first_part and downloads(a.slot):
            return (a.round, a.slot) if i > last_compute else None
    return None
