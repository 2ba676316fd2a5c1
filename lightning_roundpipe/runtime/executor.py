"""Stage executor: what one worker does for each action of a schedule, on its own device.

Each worker owns weight-less replicas of the layers (module skeletons whose tensors are on the meta
device) and runs them with :func:`torch.func.functional_call` on the stage's device copy of the
weights. Two workers never touch the same module object, and none touches the master tensors.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_roundpipe.runtime.device import WorkerDevice, layer_seed
from lightning_roundpipe.runtime.flight import Flight
from lightning_roundpipe.runtime.host_store import HostStore
from lightning_roundpipe.runtime.workers import PipelineAborted
from lightning_roundpipe.schedule.actions import Action, Op
from lightning_roundpipe.schedule.plan import Stage, StagePlan


def weightless_replica(layer: nn.Module) -> nn.Module:
    """A deep copy of ``layer`` whose parameters and buffers are meta tensors (no memory, no data)."""
    memo: dict[int, Any] = {}
    for p in layer.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in layer.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(layer, memo)


_PLAIN = (bool, int, float, str, type(None))


def plain_attributes(layers: Sequence[nn.Module]) -> list[list[dict[str, Any]]]:
    """Every submodule's plain attributes (``training``, ``p`` of a dropout, flags a user flips mid-run).

    Taken on the main thread at each batch and applied to the replicas, so that what users change on
    their modules between steps reaches the workers. Tensors travel through the host store instead.
    """
    return [[{k: v for k, v in m.__dict__.items() if type(v) in _PLAIN} for m in layer.modules()] for layer in layers]


class StageExecutor:
    """Runs the actions of one worker against a flight."""

    def __init__(
        self,
        device: WorkerDevice,
        store: HostStore,
        layers: Sequence[nn.Module],
        plan: StagePlan,
        base_seed: int,
        compute_dtype: torch.dtype | None,
    ) -> None:
        self.device = device
        self.store = store
        self.plan = plan
        self.base_seed = base_seed
        self.compute_dtype = compute_dtype
        self.replicas = [weightless_replica(layer) for layer in layers]
        self._stages = plan.stages()
        self._saved = set(plan.saved_boundaries())
        self._loaded: dict[tuple[int, int], dict[int, Tensor]] = {}

    def run(self, actions: Sequence[Action], flight: Flight, attributes: list[list[dict[str, Any]]]) -> None:
        """Run one batch's actions in order; device copies never outlive the batch."""
        for replica, layer_attributes in zip(self.replicas, attributes):
            for module, values in zip(replica.modules(), layer_attributes):
                module.__dict__.update(values)
        try:
            for action in actions:
                if flight.abort.is_set():
                    raise PipelineAborted
                try:
                    self._run(action, flight)
                except PipelineAborted:
                    raise
                except BaseException as e:
                    if hasattr(e, "add_note"):
                        e.add_note(f"(raised by roundpipe worker {self.device.index} running action {action})")
                    raise
        finally:
            self._loaded.clear()

    def _run(self, action: Action, flight: Flight) -> None:
        stage = self._stages[action.slot]
        key = (action.round, action.slot)
        if action.op is Op.LOAD:
            self._loaded[key] = {
                g: self.device.upload(self.store.groups[g].data, stage.has_gradients and self.store.groups[g].trainable)
                for g in self.store.groups_of(stage.layers)
            }
        elif action.op is Op.UNLOAD:
            weights = self._loaded.pop(key)
            if stage.has_gradients:
                waits, done = flight.grad_order[key]
                for gate in waits:
                    gate.wait()
                for g, tensor in weights.items():
                    group = self.store.groups[g]
                    if group.grad is not None and tensor.grad is not None:
                        self.device.accumulate(group.grad, tensor.grad)
                done.set()
        elif action.op is Op.FORWARD:
            self._forward(stage, action, flight)
        else:
            self._backward(stage, action, flight)

    def _layer(self, index: int, weights: dict[int, Tensor], x: Any, flight: Flight, microbatch: int) -> Any:
        tensors = {
            ref.name: weights[ref.group][ref.offset : ref.offset + ref.numel].view(ref.shape)
            for ref in self.store.layer_tensors[index]
        }
        seed = layer_seed(self.base_seed, flight.call, microbatch, index)
        with self.device.seeded(seed), self.device.autocast(self.compute_dtype):
            return functional_call(self.replicas[index], tensors, (x,))

    def _forward(self, stage: Stage, action: Action, flight: Flight) -> None:
        m = action.microbatch
        assert m is not None
        weights = self._loaded[(action.round, action.slot)]
        x = self.device.to_device(flight.take(("act", stage.start, m)))
        with torch.no_grad():
            for i in stage.layers:
                if i in self._saved and i != stage.start:
                    flight.put(("act", i, m), self.device.to_host(x))
                x = self._layer(i, weights, x, flight, m)
        flight.put(("act", stage.stop, m), self.device.to_host(x))

    def _backward(self, stage: Stage, action: Action, flight: Flight) -> None:
        """Fused stage (forward, loss, backward) or backward stage (recompute, backward)."""
        m = action.microbatch
        assert m is not None
        weights = self._loaded[(action.round, action.slot)]
        fused = action.op is Op.FUSED
        x = flight.take(("act", stage.start, m))
        out_grads = None if fused else flight.take(("grad", stage.stop, m))
        if fused and flight.weights[m] == 0.0:
            flight.losses[m] = torch.zeros((), dtype=torch.float32)
        if (fused and flight.weights[m] == 0.0) or (not fused and out_grads is None):
            # Nothing of this micro-batch reaches the loss: its gradients are zero.
            if stage.start > 0:
                flight.put(("grad", stage.start, m), None)
            return
        leaves, spec = tree_flatten(self.device.to_device(x))
        if stage.start > 0:
            leaves = [t.requires_grad_() if _differentiable(t) else t for t in leaves]
        with torch.enable_grad():
            # Layers get non-leaf copies, so an in-place first operation (ReLU(inplace=True)) is legal.
            x = tree_unflatten([t.clone() if isinstance(t, Tensor) and t.requires_grad else t for t in leaves], spec)
            for i in stage.layers:
                x = self._layer(i, weights, x, flight, m)
            if fused:
                with self.device.autocast(self.compute_dtype):
                    loss = flight.loss_fn(x, self.device.to_device(flight.targets[m]))
                if not isinstance(loss, Tensor) or loss.dim() != 0:
                    shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
                    raise ValueError(f"loss_fn must return a scalar tensor, got {shape}")
                flight.losses[m] = loss.detach().float().cpu() * flight.weights[m]
                roots, root_grads = [loss * (flight.weights[m] * flight.grad_scale)], None
            else:
                out_leaves, _ = tree_flatten(x)
                pairs = [
                    (o, self.device.to_device(g))
                    for o, g in zip(out_leaves, out_grads)  # type: ignore[arg-type]
                    if g is not None and isinstance(o, Tensor) and o.requires_grad
                ]
                roots, root_grads = [o for o, _ in pairs], [g for _, g in pairs]
        if roots:
            torch.autograd.backward(roots, root_grads)
        if stage.start > 0:
            grads = [t.grad if isinstance(t, Tensor) and t.requires_grad else None for t in leaves]
            flight.put(
                ("grad", stage.start, m),
                self.device.to_host(grads) if any(g is not None for g in grads) else None,
            )


def _differentiable(t: Any) -> bool:
    return isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex())
