"""Weight-less replicas: one worker's copies of the layers, run on a slot's device tensors.

Each worker owns module skeletons whose tensors are on the meta device and runs them on the stage's
device copy of the weights: two workers never touch the same module object, and none touches the
master tensors.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_roundpipe.runtime.device import WorkerDevice, layer_seed

_PLAIN = (bool, int, float, str, type(None))


def weightless_replica(layer: nn.Module) -> nn.Module:
    """A deep copy of ``layer`` whose parameters and buffers are meta tensors (no memory, no data)."""
    memo: dict[int, Any] = {}
    for p in layer.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in layer.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(layer, memo)


def plain_attributes(layers: Sequence[nn.Module]) -> list[list[dict[str, Any]]]:
    """Every submodule's plain attributes (``training``, ``p`` of a dropout, flags a user flips mid-run).

    Taken on the main thread at each batch and applied to the replicas, so that what users change on
    their modules between steps reaches the workers. Tensors travel through the host store instead.
    """
    return [[{k: v for k, v in m.__dict__.items() if type(v) in _PLAIN} for m in layer.modules()] for layer in layers]


class Replicas:
    """One worker's weight-less replicas of the layers, and how one runs on device tensors."""

    def __init__(
        self,
        device: WorkerDevice,
        layers: Sequence[nn.Module],
        layer_tensors: Sequence[Sequence[Any]],
        base_seed: int,
        autocast_dtype: torch.dtype | None,
    ) -> None:
        self.device = device
        self.base_seed = base_seed
        """Settable: a restored engine state changes it before the first batch."""
        self.autocast_dtype = autocast_dtype
        self.modules = [weightless_replica(layer) for layer in layers]
        for replica in self.modules:  # what a compiled forward (``compile=...``) runs compiled on, per device
            for module in replica.modules():
                module._roundpipe_replica = str(device.device)
        self._slots_of = [_tensor_slots(replica, refs) for replica, refs in zip(self.modules, layer_tensors)]
        self._buffers_of = [[slot[0] for slot in slots if slot[1] is not _owner(r, slot[0])._parameters]
                            for slots, r in zip(self._slots_of, self.modules)]  # fmt: skip
        """Per layer, its buffers: a forward's in-place change to one stays on the worker's copy."""
        self._warned: set[int] = set()

    def apply(self, attributes: list[list[dict[str, Any]]]) -> None:
        """Give the replicas this batch's :func:`plain_attributes` of the user's modules."""
        for replica, layer_attributes in zip(self.modules, attributes):
            for module, values in zip(replica.modules(), layer_attributes):
                module.__dict__.update(values)

    def run(self, index: int, named: dict[str, Tensor], x: Any, call: int, microbatch: int) -> Any:
        """Run layer ``index`` on the slot's device tensors ``named``, seeded for batch ``call``.

        The tensors are put into the replica's parameter and buffer slots for the call and the meta
        placeholders put back after (what ``functional_call`` does, without its per-call overhead).
        """
        seed, buffers = layer_seed(self.base_seed, call, microbatch, index), self._buffers_of[index]
        self._put(index, named)  # (not `bound`: a generator's cost, per layer and micro-batch)
        versions = [named[name]._version for name in buffers]
        try:
            with self.device.seeded(seed), self.device.autocast(self.autocast_dtype):
                out = self.modules[index](x)
        finally:
            self._take_back(index)
        if not buffers or index in self._warned:
            return out
        changed = [name for name, v in zip(buffers, versions) if named[name]._version != v]
        if changed:
            self._warned.add(index)
            warnings.warn(
                f"roundpipe: layer {index}'s forward changed its buffers {changed} in place. The workers run on device"
                " copies of them, which never come back to the module: it keeps their values from before training"
                " (running statistics, counters). Plain training would update them.",
                stacklevel=2,
            )
        return out

    @contextlib.contextmanager
    def bound(self, weights: dict[int, dict[str, Tensor]]) -> Iterator[None]:
        """Layers' replicas hold the slot's device tensors (``weights``: per layer index, by name) inside, the
        meta placeholders after. Around a stage's backward too: a layer that checkpoints itself
        (``torch.utils.checkpoint`` inside it) runs its forward again there, on its module's tensors."""
        for index, named in weights.items():
            self._put(index, named)
        try:
            yield
        finally:
            for index in weights:
                self._take_back(index)

    def _put(self, index: int, named: dict[str, Tensor]) -> None:
        for name, table, attr, _ in self._slots_of[index]:
            table[attr] = named[name]

    def _take_back(self, index: int) -> None:
        for _, table, attr, placeholder in self._slots_of[index]:
            table[attr] = placeholder


def _owner(replica: nn.Module, name: str) -> nn.Module:
    return replica.get_submodule(name.rpartition(".")[0])


def _tensor_slots(replica: nn.Module, refs: Sequence[Any]) -> list[tuple[str, dict[str, Any], str, Any]]:
    """Where each named tensor of a layer lives in its replica: (name, the owning module's parameter or
    buffer table, attribute, meta placeholder)."""
    slots = []
    for ref in refs:
        owner_name, _, attr = ref.name.rpartition(".")
        owner = replica.get_submodule(owner_name)
        table = owner._parameters if attr in owner._parameters else owner._buffers
        slots.append((ref.name, table, attr, table[attr]))
    return slots
