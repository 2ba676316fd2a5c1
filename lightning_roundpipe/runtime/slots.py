"""Slot state of one worker: what its action handlers share during a batch.

The handlers of weight uploads, compute and gradient unloads each get the same :class:`WorkerSlots`:
the worker's device and the host store, the current plan's stage tables, and the slots whose weights
are on the device, keyed ``(round, slot)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from lightning_roundpipe.runtime.device import WorkerDevice
from lightning_roundpipe.runtime.host_store import HostStore
from lightning_roundpipe.runtime.resident import ResidentStates
from lightning_roundpipe.schedule.plan import Stage, StagePlan
from lightning_roundpipe.schedule.transfers import pack_parts

Parts = list[list[tuple[int, int, int]]]
"""Per part of a transfer, its pieces: (group, start, stop) in elements."""


@dataclass
class LoadedSlot:
    """A slot's weights on this worker, from upload to unload."""

    flats: dict[int, Tensor]
    ready: Any = None
    """Event after the last upload part; compute waits for it once."""
    taken: Any = None
    """Buffers from the compute stream's pool: the event on it after which the upload may write them."""
    tensors: dict[int, dict[str, Tensor]] | None = None
    """Per layer, the named tensors handed to ``functional_call``; built at the slot's first compute."""
    grads: dict[int, Tensor] = field(default_factory=dict)
    """Flat gradient buffers of the trainable groups: every parameter's ``.grad`` is a view into one."""
    backward_ran: bool = False
    last_compute: Any = None
    downloads: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)
    """Per group, (device source, host destination) of the gradient download."""
    staging: dict[int, Tensor] = field(default_factory=dict)
    summed_here: set[int] = field(default_factory=set)
    """Groups whose host partial sum comes up to be added on this device (``GradientUnloads._add_on_device``)."""


class WorkerSlots:
    """The device, the host store, the current plan's tables and the loaded slots of one worker."""

    def __init__(self, device: WorkerDevice, store: HostStore, plan: StagePlan) -> None:
        self.device = device
        self.store = store
        self.loaded: dict[tuple[int, int], LoadedSlot] = {}
        self._tables: dict[StagePlan, tuple[Any, ...]] = {}
        self.plan = plan
        self.stages: tuple[Stage, ...] = ()
        self.saved: set[int] = set()
        """Layers whose input a forward stage keeps for a backward stage's recompute."""
        self.groups: dict[int, tuple[int, ...]] = {}
        """Per slot, the groups of its layers (what its weight upload copies)."""
        self.trainable: dict[int, tuple[int, ...]] = {}
        """Per slot, its trainable groups (what its gradient unload copies)."""
        self._pieces: dict[tuple[int, str, int], Parts] = {}
        self.resident: ResidentStates | None = None
        """``optimizer_on="device"``: the trainable groups' states on this device (training reads its copies)."""
        self.use_plan(plan)

    def use_plan(self, plan: StagePlan) -> None:
        """Stage tables of ``plan`` (cached): the plan may change between batches."""
        if plan not in self._tables:
            stages = plan.stages()
            groups = {s.slot: self.store.groups_of(s.layers) for s in stages}
            trainable = {k: tuple(g for g in gs if self.store.groups[g].trainable) for k, gs in groups.items()}
            self._tables[plan] = (stages, set(plan.saved_boundaries()), groups, trainable, {})
        self.plan = plan
        self.stages, self.saved, self.groups, self.trainable, self._pieces = self._tables[plan]

    def drop(self, key: tuple[int, int]) -> None:
        """Forget a slot at its unload: its gradient buffers, and its weights if still held (:meth:`release`)."""
        self.release(key)
        del self.loaded[key]

    def release(self, key: tuple[int, int]) -> None:
        """Give a slot's weight buffers back while its gradients stay. Buffers from the compute stream's pool go
        back to it at once, so where compute never read them (every micro-batch of the run skipped: a zero loss
        weight, no gradient in) compute first waits for their upload, which may still be queued."""
        loaded = self.loaded[key]
        if loaded.flats and loaded.tensors is None and loaded.taken is not None:
            dev = self.device
            dev.wait(dev.compute, loaded.ready if loaded.ready is not None else dev.record(dev.param_up))
        loaded.flats, loaded.tensors = {}, None

    def largest_gradients(self) -> int:
        """Bytes of the largest slot's gradients on the device (in the compute copies' dtype)."""
        return max((sum(self.store.groups[g].compute.nbytes for g in gs) for gs in self.trainable.values()), default=0)

    def downloads_gradients(self, slot: int) -> bool:
        return self.stages[slot].has_gradients and bool(self.trainable[slot])

    def parts(self, slot: int, what: str, parts: int) -> Parts:
        """Pieces of each of the ``parts`` parts of a slot's weight (``"W"``) or gradient (``"G"``) transfer."""
        key = (slot, what, parts)
        if key not in self._pieces:
            groups = self.groups[slot] if what == "W" else self.trainable[slot]
            sizes = [
                (g, self.store.groups[g].compute.numel(), self.store.groups[g].compute.element_size()) for g in groups
            ]
            self._pieces[key] = pack_parts(sizes, parts)
        return self._pieces[key]
