"""A prototype, for measurement only: the optimizer's states kept on the one GPU (``newcomer-resident``).

Issue 39's 8 sequences a step are bound by the host optimizer step, which the host's memory bandwidth bounds
(docs/benchmarks.md, twentieth session): AdamW's math, the cast and the transfers move about 40 bytes a parameter a
step through host memory, and letting them overlap more made the step slower. Where the fp32 masters, the gradients,
AdamW's two moments and two bf16 compute copies fit on the card beside the plan (about 20 bytes a parameter: 34 GB for
the 1.7B shape on a 141 GB card), none of that needs the host. This patches the running engine to do so, keeping its
order exactly (staleness one, the same five edges of ``runtime/optimizer_worker.py``), so its losses should match the
defaults' to bf16 rounding:

- **uploads** (``W``): a trainable group's slot tensor is the device copy for the step's parity (step k reads copy
  ``k % 2``), after the wait for the cast of update k - 2 (edge 2); nothing crosses PCIe;
- **gradients** (``G``): the slot's bf16 gradient is copied (first write of the step, after edge 4's wait) or added
  into the group's fp32 device gradient on the gradients-down stream, and the collector's job only waits for that;
- **the update** (optimizer thread): per group, deep first, once its gradient is complete (edge 3), the user's
  optimizer class steps a device shadow of the group's parameters, then the master is cast into copy ``k % 2``, which
  step k read last (its gradient is complete, so step k is done with it: edge 1 holds by edge 3); the thread waits for
  the device before opening the group's gates (edges 4 and 2).

Not handled (the benchmark needs none of it): several devices or nodes, evaluation, checkpoints (the host masters
stay at their initial values), ``16-mixed``, clipping, batches run again after running out of memory. One device.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import time
from collections.abc import Iterator
from functools import partial
from typing import Any
from unittest import mock

import torch
from torch import nn


class Resident:
    """Per trainable group: the fp32 master, its gradient and two compute copies on the device, and a shadow
    of the user's optimizer over the device masters (its states on the device too)."""

    def __init__(self, store: Any, dev: Any) -> None:
        self.store, self.dev = store, dev
        self.stream = torch.cuda.Stream(dev.device) if dev.device.type == "cuda" else None
        self.master: dict[int, torch.Tensor] = {}
        self.grad: dict[int, torch.Tensor] = {}
        self.copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for group in store.groups:
            if group.trainable:
                g = group.index
                self.master[g] = group.data.to(dev.device, copy=True)
                self.grad[g] = torch.zeros_like(self.master[g])
                compute = group.compute.to(dev.device, copy=True)
                self.copies[g] = (compute, compute.clone())
        self.shadow: torch.optim.Optimizer | None = None
        self.params: dict[int, list[tuple[nn.Parameter, torch.Tensor]]] = {}

    def reads(self, g: int, step: int) -> torch.Tensor:
        return self.copies[g][step % 2]

    def build_shadow(self, optimizer: torch.optim.Optimizer) -> None:
        """The user's optimizer class and hyper-parameters over device views of the masters, its states its own."""
        shadow = copy.copy(optimizer)
        shadow.__dict__.pop("step", None)  # an LR scheduler's wrapper bound to the real optimizer
        of: dict[int, nn.Parameter] = {}
        for group in self.store.groups:
            if group.trainable:
                pairs = []
                for p, offset in group.params:
                    view = self.master[group.index][offset : offset + p.numel()].view(p.shape)
                    sp = nn.Parameter(view, requires_grad=True)
                    of[id(p)] = sp
                    grad = self.grad[group.index][offset : offset + p.numel()].view(p.shape)
                    pairs.append((sp, grad))
                self.params[group.index] = pairs
        shadow.param_groups = [
            {**group, "params": [of[id(p)] for p in group["params"] if id(p) in of]} for group in optimizer.param_groups
        ]
        shadow.state = collections.defaultdict(dict)  # type: ignore[assignment]
        self.shadow = shadow

    def update(self, job: Any) -> None:
        """Update ``job.step`` on the device, group by group in the job's (deep-first) order."""
        assert job.spec is not None and job.spec.clip_value is None and job.spec.scaler is None
        if self.shadow is None:
            self.build_shadow(job.spec.optimizer)
        assert self.shadow is not None
        for group, hyper in zip(self.shadow.param_groups, job.spec.hyperparameters):
            group.update(hyper)
        for g in job.groups:
            job.grads_complete[g].wait()  # edge 3: the collector saw the device add complete
            with self.dev.on(self.stream):
                for sp, grad in self.params[g]:
                    sp.grad = grad
                self.shadow.step()
                for sp, _ in self.params[g]:
                    sp.grad = None
                self.copies[g][job.step % 2].copy_(self.master[g])  # what step k + 2 reads
            self.dev.host_wait(self.dev.record(self.stream))
            job.consumed[g].set()  # edge 4: the next step's first write may overwrite the gradient
            job.cast_done[g].set()  # edge 2: step k + 2 may read its copy


_state: dict[str, Any] = {}


@contextlib.contextmanager
def resident_optimizer() -> Iterator[None]:
    from lightning_roundpipe.runtime.collector import GradJob
    from lightning_roundpipe.runtime.optimizer_worker import OptimizerWorker
    from lightning_roundpipe.runtime.slots import LoadedSlot
    from lightning_roundpipe.runtime.unloads import GradientUnloads
    from lightning_roundpipe.runtime.uploads import WeightUploads

    load, unload, run = WeightUploads.load, GradientUnloads.unload, OptimizerWorker._run

    def resident_of(store: Any, dev: Any) -> Resident:
        if _state.get("store") is not store:
            _state.update(store=store, resident=Resident(store, dev))
        return _state["resident"]

    def resident_load(self: WeightUploads, stage: Any, action: Any, flight: Any) -> None:
        if flight.evaluating:
            return load(self, stage, action, flight)
        resident, dev = resident_of(self.store, self.device), self.device
        key = (action.round, action.slot)
        if action.is_first_part:
            waiting = time.perf_counter()
            for g in self.slots.trainable[stage.slot]:  # edge 2
                gate = flight.upload_waits.get(g)
                if gate is not None:
                    gate.wait()
            flight.waited("casts", waiting)
            groups = self.store.groups
            self.slots.loaded[key] = LoadedSlot(
                {
                    g: resident.reads(g, flight.step)
                    if g in resident.master
                    else dev.empty(groups[g].compute.numel(), groups[g].compute.dtype, dev.param_up)
                    for g in self.slots.groups[stage.slot]
                }
            )
        loaded = self.slots.loaded[key]
        for g, start, stop in self.slots.parts(stage.slot, "W", action.parts)[action.part]:
            if g not in resident.master:
                source = self.store.reads(g, flight.step)
                dev.copy_up(loaded.flats[g][start:stop], source[start:stop], dev.param_up)
        if action.is_last_part:
            loaded.ready = dev.record(dev.param_up)
        return None

    def resident_unload(self: GradientUnloads, stage: Any, action: Any, flight: Any) -> None:
        if not stage.has_gradients or flight.evaluating:
            return unload(self, stage, action, flight)
        resident, dev = resident_of(self.store, self.device), self.device
        key = (action.round, action.slot)
        loaded = self.slots.loaded[key]
        waits, done = flight.grad_order[key]
        overwrite = flight.overwrite[key]
        if action.is_first_part:
            if any(g in overwrite for g in self.slots.trainable[stage.slot]):
                waiting = time.perf_counter()
                for gate in waits:  # edge 4
                    gate.wait()
                flight.waited("update reads", waiting)
            dev.wait(dev.grad_down, dev.record(dev.compute))  # every read and write of the slot so far
            with dev.on(dev.grad_down):
                for g in self.slots.trainable[stage.slot]:
                    grad = loaded.grads.get(g) if loaded.backward_ran else None
                    if grad is None:
                        if g in overwrite:
                            resident.grad[g].zero_()  # no gradient reached it: the step's sum starts at zero
                    elif g in overwrite:
                        resident.grad[g].copy_(grad)
                    else:
                        resident.grad[g].add_(grad)
                    if grad is not None:
                        dev.keep_alive(grad, dev.grad_down)
        if action.is_last_part:
            copied = dev.record(dev.grad_down)
            del self.slots.loaded[key]
            landed = partial(flight.host_writes.slot_landed, key)
            self.collector.submit(GradJob({}, copied, waits, done, [], landed))
            self.collecting.append(done)
        return None

    def resident_run(self: OptimizerWorker, job: Any) -> None:
        if job.spec is None or "resident" not in _state:
            return run(self, job)
        start = time.perf_counter()
        _state["resident"].update(job)
        self.last_update = (job.step, time.perf_counter() - start)
        job.math_done.set()
        return None

    with (
        mock.patch.object(WeightUploads, "load", resident_load),
        mock.patch.object(GradientUnloads, "unload", resident_unload),
        mock.patch.object(OptimizerWorker, "_run", resident_run),
    ):
        try:
            yield
        finally:
            _state.clear()
