"""Compute actions: forward, evaluate, fused and backward stages of one micro-batch.

Each uploads its inputs on the activations-up stream, computes on the compute stream, and downloads
its outputs on the activations-down stream, each step waiting for the previous one's event. The
thread stays at most ``max_inflight`` micro-batches ahead of its device, which bounds device memory.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_roundpipe.runtime.flight import Flight
from lightning_roundpipe.runtime.host_pool import Parcel
from lightning_roundpipe.runtime.replicas import Replicas
from lightning_roundpipe.runtime.slots import LoadedSlot, WorkerSlots
from lightning_roundpipe.runtime.uploads import slot_tensors
from lightning_roundpipe.schedule.actions import Action
from lightning_roundpipe.schedule.plan import Stage

Roots = Callable[[Any], tuple[list[Tensor], list[Tensor] | None]]
"""From a stage's output, what backward starts from: the tensors and their gradients (``None``: ones)."""


class StageCompute:
    """Runs a slot's layers on its loaded weights for one micro-batch, with or without backward."""

    def __init__(self, slots: WorkerSlots, replicas: Replicas, max_inflight: int) -> None:
        self.slots = slots
        self.device = slots.device
        self.store = slots.store
        self.replicas = replicas
        self.max_inflight = max_inflight
        self.inflight: deque[Any] = deque()
        """Events of the last compute actions issued; the oldest is waited for beyond ``max_inflight``."""

    def forward(self, stage: Stage, action: Action, flight: Flight) -> None:
        dev, m = self.device, action.microbatch
        assert m is not None
        x, ready = self._input(flight, stage, m)
        with dev.on(dev.compute), torch.no_grad():
            weights = slot_tensors(self.slots, stage, action)
            dev.wait(dev.compute, ready)
            start = dev.timer(dev.compute) if flight.record else None
            mark = dev.memory_mark() if flight.measure_memory else None
            for i in stage.layers:
                if i in self.slots.saved and i != stage.start and not flight.evaluating:
                    flight.put(("act", i, m), dev.download(x, dev.record(dev.compute)))
                x = self.replicas.run(i, weights[i], x, flight.call, m)
            done = dev.record(dev.compute)
            if mark is not None:
                flight.memory.append((action, dev.memory_peak_since(mark)))
            if flight.record:
                flight.records.setdefault(dev.index, []).append((action, start, None, dev.timer(dev.compute), 0))
        flight.put(("act", stage.stop, m), dev.download(x, done))
        self._finish(flight, (action.round, action.slot), done)

    def evaluate(self, stage: Stage, action: Action, flight: Flight) -> None:
        """The fused stage of a forward-only pass: the last layers, then the loss (or the output itself)."""
        dev, m = self.device, action.microbatch
        assert m is not None
        x, x_ready = self._input(flight, stage, m)
        target = None
        if flight.loss_fn is not None:
            target = self._target(flight, m)
            if flight.weights[m] == 0.0:  # nothing to average over (all targets ignored): adds 0, as in training
                flight.set_loss(m, Parcel(torch.zeros((), dtype=torch.float32)))
                return
        with dev.on(dev.compute), torch.no_grad():
            weights = slot_tensors(self.slots, stage, action, gradients=False)
            for event in (x_ready, target and target[1]):
                dev.wait(dev.compute, event)
            for i in stage.layers:
                x = self.replicas.run(i, weights[i], x, flight.call, m)
            if flight.loss_fn is not None:
                assert target is not None
                x = self._loss(flight, x, target[0]).detach().float() * flight.weights[m]
            done = dev.record(dev.compute)
        flight.set_loss(m, dev.download(x, done))
        self._finish(flight, (action.round, action.slot), done)

    def fused(self, stage: Stage, action: Action, flight: Flight) -> None:
        """Fused stage: forward through the last layers, the loss, backward; the loss and input gradients down."""
        dev, m = self.device, action.microbatch
        assert m is not None
        x, x_ready = self._input(flight, stage, m)
        target = self._target(flight, m)
        if flight.weights[m] == 0.0:
            flight.set_loss(m, Parcel(torch.zeros((), dtype=torch.float32)))
            # Nothing of this micro-batch reaches the loss: its gradients are zero.
            if stage.start > 0:
                flight.put(("grad", stage.start, m), None)
            return

        def roots(output: Any) -> tuple[list[Tensor], list[Tensor] | None]:
            loss = self._loss(flight, output, target[0])
            weighted = loss.detach().float() * flight.weights[m]
            # Down before the backward: asynchronously the host's turn, and with it the next batch's
            # dispatch and first upload, overlap this backward instead of following it (one worker, all
            # fused: the next batch's first weights otherwise came up while the device idled).
            flight.set_loss(m, dev.download(weighted, dev.record(dev.compute)))
            return [loss * (flight.weights[m] * flight.grad_scale)], None

        done, leaves = self._differentiate(stage, action, flight, x, (x_ready, target[1]), roots)
        self._input_grads(stage, flight, m, leaves, done)
        self._finish(flight, (action.round, action.slot), done)

    def backward(self, stage: Stage, action: Action, flight: Flight) -> None:
        """Backward stage: recompute from the saved input, backward from the output gradients; input gradients down."""
        m = action.microbatch
        assert m is not None
        x, x_ready = self._input(flight, stage, m)
        grads_in = self._take(flight, ("grad", stage.stop, m))
        if grads_in is None:
            # Nothing of this micro-batch reaches the loss: its gradients are zero.
            if stage.start > 0:
                flight.put(("grad", stage.start, m), None)
            return
        output_grads = grads_in[0]

        def roots(output: Any) -> tuple[list[Tensor], list[Tensor] | None]:
            pairs = [
                (o, g)
                for o, g in zip(tree_flatten(output)[0], output_grads)
                if g is not None and isinstance(o, Tensor) and o.requires_grad
            ]
            return [o for o, _ in pairs], [g for _, g in pairs]

        done, leaves = self._differentiate(stage, action, flight, x, (x_ready, grads_in[1]), roots)
        self._input_grads(stage, flight, m, leaves, done)
        self._finish(flight, (action.round, action.slot), done)

    def _differentiate(
        self, stage: Stage, action: Action, flight: Flight, x: Any, events: tuple[Any, ...], roots_of: Roots
    ) -> tuple[Any, list[Any]]:
        """The stage's layers with autograd from input ``x`` (once ``events`` passed), then backward from
        ``roots_of(output)``; returns the compute event after it and the input's leaves (their ``.grad``)."""
        dev, m = self.device, action.microbatch
        assert m is not None
        with dev.on(dev.compute):
            weights = slot_tensors(self.slots, stage, action)
            for event in events:
                dev.wait(dev.compute, event)
            leaves, spec = tree_flatten(x)
            if stage.start > 0:
                leaves = [t.requires_grad_() if _differentiable(t) else t for t in leaves]
            start = dev.timer(dev.compute) if flight.record else None
            weights_storage = {flat.untyped_storage().data_ptr() for flat in weights_flats(self.slots.loaded, action)}
            saved = _SavedBytes(weights_storage) if flight.record else contextlib.nullcontext()
            mark = dev.memory_mark() if flight.measure_memory else None
            with torch.enable_grad(), saved:
                # Layers get non-leaf copies, so an in-place first operation (ReLU(inplace=True)) is legal.
                x = tree_unflatten(
                    [t.clone() if isinstance(t, Tensor) and t.requires_grad else t for t in leaves], spec
                )
                for i in stage.layers:
                    x = self.replicas.run(i, weights[i], x, flight.call, m)
                roots, root_grads = roots_of(x)
            mid = dev.timer(dev.compute) if flight.record else None
            if roots:
                # A layer that checkpoints itself runs its forward again in here: on its weights, and holding the
                # device's generator where workers share it (CPU workers: the recompute restores the forward's
                # state into it). Nothing in a backward may call Replicas.run: on CPU its lock is held here. On a
                # GPU the recompute also puts back torch's CPU generator, which nothing holds: CPU draws elsewhere
                # meanwhile may repeat.
                with self.replicas.bound({i: weights[i] for i in stage.layers}), dev.generator_held():
                    torch.autograd.backward(roots, root_grads)
                self.slots.loaded[(action.round, action.slot)].backward_ran = True
            done = dev.record(dev.compute)
            if mark is not None:
                grads = sum(self.store.groups[g].compute.nbytes for g in self.slots.trainable[stage.slot])
                flight.memory.append((action, max(0, dev.memory_peak_since(mark) - saved.bytes - grads)))
            if flight.record:
                end = dev.timer(dev.compute)
                flight.records.setdefault(dev.index, []).append((action, start, mid, end, saved.bytes))
        return done, leaves

    def _input_grads(self, stage: Stage, flight: Flight, m: int, leaves: list[Any], done: Any) -> None:
        """Download the gradients of the stage input for the stage before (none for the first layer)."""
        dev = self.device
        if stage.start > 0:
            grads = [t.grad if isinstance(t, Tensor) and t.requires_grad else None for t in leaves]
            has_any = any(g is not None for g in grads)
            flight.put(("grad", stage.start, m), dev.download(grads, done) if has_any else None)

    def _loss(self, flight: Flight, output: Any, target: Any) -> Tensor:
        """``loss_fn`` on a micro-batch's output, under the workers' autocast; refused unless a scalar."""
        assert flight.loss_fn is not None
        with self.device.autocast(self.replicas.autocast_dtype):
            loss = flight.loss_fn(output, target)
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(f"loss_fn must return a scalar tensor, got {shape}")
        return loss

    def _input(self, flight: Flight, stage: Stage, m: int) -> tuple[Any, Any]:
        """The stage input of micro-batch ``m`` on this device, and the event after which it is there."""
        taken = self._take(flight, ("act", stage.start, m))
        assert taken is not None
        return taken

    def _target(self, flight: Flight, m: int) -> tuple[Any, Any]:
        """Micro-batch ``m``'s target on this device; its host buffers go back once the upload is done."""
        target = self.device.upload(flight.targets[m])
        flight.pool.release(flight.targets[m], [target[1]])
        return target

    def _take(self, flight: Flight, key: tuple[str, int, int]) -> tuple[Any, Any] | None:
        """Upload a mailbox's value to this device; ``None`` if it holds no value (a zero gradient)."""
        waiting = time.perf_counter()
        parcel = flight.take(key)
        flight.waited("inputs", waiting)
        if parcel is None:
            flight.release(key)
            return None
        value, ready = self.device.upload(parcel)
        flight.release(key, ready)
        return value, ready

    def _finish(self, flight: Flight, loaded_key: tuple[int, int], done: Any) -> None:
        self.slots.loaded[loaded_key].last_compute = done
        self.inflight.append(done)
        waiting = time.perf_counter()
        while len(self.inflight) > self.max_inflight:
            self.device.host_wait(self.inflight.popleft())
        flight.waited("inflight", waiting)


def weights_flats(loaded: dict[tuple[int, int], LoadedSlot], action: Action) -> list[Tensor]:
    """The device buffers of a slot's weights and gradients (their memory is not activation memory)."""
    entry = loaded[(action.round, action.slot)]
    return [*entry.flats.values(), *entry.grads.values()]


class _SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Counts the activation bytes autograd saves for backward inside the block (each storage once;
    the stage's weights, which it saves too, excluded)."""

    def __init__(self, exclude: set[int]) -> None:
        self.bytes = 0
        seen: set[int] = set(exclude)

        def pack(t: Tensor) -> Tensor:
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                self.bytes += t.untyped_storage().nbytes()
            return t

        super().__init__(pack, lambda t: t)


def _differentiable(t: Any) -> bool:
    return isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex())
