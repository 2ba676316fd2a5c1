"""Host store: the model's master weights and gradients, packed into flat host buffers per layer.

Every parameter and buffer of a layer moves into one contiguous buffer per (dtype, kind) group, and
the module's own tensors become views into it. The LightningModule and its optimizer keep working on
the very same ``nn.Parameter`` objects, while a stage's weights travel as a few large copies.

Each group has three buffers of one layout: ``data`` (the master: what the optimizer updates),
``compute`` (what is uploaded to workers: the master cast to the compute dtype, or the master itself
when no cast is needed) and, for trainable groups, ``grad`` (the gradients the optimizer reads, in
the master dtype). Module buffers keep their dtype: only parameters are cast for compute.

Double buffering (asynchronous optimizer, :meth:`HostStore.add_spares`): trainable groups get a
``spare`` compute copy; even steps upload from ``compute``, odd ones from ``spare``
(:meth:`HostStore.reads`). Update ``k`` is then cast into the copy step ``k + 2`` reads, which only
step ``k`` read before, so the cast need not wait for step ``k + 1``'s uploads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class TensorRef:
    """Where one named tensor of a layer lives: ``group``'s flat buffer at ``offset`` with ``shape``."""

    name: str
    group: int
    offset: int
    shape: torch.Size

    @property
    def numel(self) -> int:
        return self.shape.numel()


@dataclass
class FlatGroup:
    """Tensors of one layer that share dtype and kind (``"trainable"``, ``"frozen"`` or ``"buffer"``)."""

    index: int
    layer: int
    kind: str
    data: Tensor
    compute: Tensor
    grad: Tensor | None
    params: list[tuple[nn.Parameter, int]] = field(default_factory=list)
    """Trainable parameters in this group and their offsets, to point ``p.grad`` into ``grad``."""
    members: list[Tensor] = field(default_factory=list)
    """Every module tensor living in this group (their version counters tell of in-place edits)."""
    spare: Tensor | None = None
    """Second compute copy (double buffering): what odd steps upload."""
    synced_version: int = -1
    """Sum of the members' version counters when ``compute`` was last refreshed."""
    dirty: bool = False

    def version(self) -> int:
        return sum(t._version for t in self.members)

    @property
    def trainable(self) -> bool:
        return self.kind == "trainable"


class HostStore:
    """Master weights and gradients of a layer sequence, in flat host buffers."""

    def __init__(
        self, layers: Sequence[nn.Module], compute_dtype: torch.dtype | None = None, separate_compute: bool = False
    ) -> None:
        self.num_layers = len(layers)
        self.compute_dtype = compute_dtype
        self.separate_compute = separate_compute
        """Give trainable groups their own compute copy even when no cast is needed (the asynchronous
        optimizer updates the masters while workers still read the previous weights)."""
        self.groups: list[FlatGroup] = []
        self.layer_tensors: list[tuple[TensorRef, ...]] = []
        self._layer_groups: list[tuple[int, ...]] = []
        self.parameters: list[nn.Parameter] = []
        self.fresh_grads: set[int] = set()
        """Trainable groups not written since the last clear: their next write overwrites."""
        pending: dict[tuple[int, torch.dtype, str], list[Tensor]] = {}
        named: list[list[tuple[str, Tensor]]] = []
        seen: set[int] = set()
        self._running_statistics = [  # batch norms: a training forward updates their buffers in place
            (i, m) for i, layer in enumerate(layers) for m in layer.modules()
            if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats
        ]  # fmt: skip
        for i, layer in enumerate(layers):
            tensors = list(layer.named_parameters(remove_duplicate=False))
            tensors += list(layer.named_buffers(remove_duplicate=False))
            named.append(tensors)
            for _, t in tensors:
                if id(t) not in seen:
                    seen.add(id(t))
                    if isinstance(t, nn.Parameter):
                        self.parameters.append(t)
                        kind = "trainable" if t.requires_grad else "frozen"
                    else:
                        kind = "buffer"
                    pending.setdefault((i, t.dtype, kind), []).append(t)
        placed: dict[int, TensorRef] = {}
        for (layer_index, dtype, kind), tensors in pending.items():
            placed.update(self._pack(layer_index, dtype, kind, tensors))
        self.fresh_grads = {g.index for g in self.groups if g.trainable}
        for tensors in named:
            refs = tuple(
                TensorRef(name, placed[id(t)].group, placed[id(t)].offset, placed[id(t)].shape) for name, t in tensors
            )
            self.layer_tensors.append(refs)
            self._layer_groups.append(tuple(dict.fromkeys(r.group for r in refs)))

    def _pack(self, layer: int, dtype: torch.dtype, kind: str, tensors: list[Tensor]) -> dict[int, TensorRef]:
        """Copy ``tensors`` into one new flat buffer and make them views of it."""
        refs: dict[int, TensorRef] = {}
        total = sum(t.numel() for t in tensors)
        data = torch.empty(total, dtype=dtype)
        cast = kind != "buffer" and self.compute_dtype is not None and dtype.is_floating_point
        compute_dtype = self.compute_dtype if cast else dtype
        if kind == "frozen" and cast:
            # never updated, only computed with: keep one copy, in the compute dtype (2 bytes per
            # parameter in bf16; the module's frozen parameters become views of it)
            data = torch.empty(total, dtype=compute_dtype)
            dtype = compute_dtype
        separate = (cast and compute_dtype != dtype) or (self.separate_compute and kind == "trainable")
        compute = torch.empty(total, dtype=compute_dtype) if separate else data
        grad = torch.zeros_like(data) if kind == "trainable" else None
        group = FlatGroup(len(self.groups), layer, kind, data, compute, grad)
        self.groups.append(group)
        offset = 0
        for t in tensors:
            n = t.numel()
            view = data[offset : offset + n]
            view.copy_(t.detach().reshape(-1))
            t.data = view.view(t.shape)  # in the group's dtype (frozen parameters: the compute dtype)
            group.members.append(t)
            if kind == "trainable":
                assert isinstance(t, nn.Parameter)
                group.params.append((t, offset))
            refs[id(t)] = TensorRef("", group.index, offset, t.shape)
            offset += n
        self._refresh(group)
        return refs

    def refresh_group(self, index: int, step: int = 0, copy: bool = True) -> None:
        """Cast one group's master into the compute copy step ``step`` reads (the asynchronous
        optimizer's per-layer cast of update ``step - 2``, or ``step``: same parity). ``copy=False``: that
        copy (:meth:`reads`) took the master by other means (the update's one-pass kernel)."""
        group = self.groups[index]
        if group.spare is not None and step % 2:
            if copy:
                group.spare.copy_(group.data)
            return
        self._refresh(group, copy)

    def add_spares(
        self, groups: Iterable[int] | None = None, prepare: Callable[[Tensor], Any] | None = None
    ) -> list[Tensor]:
        """Give trainable groups with a separate compute copy (``groups``, or all) a second one (double
        buffering), holding the same values; ``prepare`` (e.g. pinning) runs on each before it is
        published. Returns the new buffers."""
        spares = []
        for group in self.groups if groups is None else [self.groups[g] for g in groups]:
            if group.trainable and group.compute is not group.data and group.spare is None:
                spare = group.compute.clone()
                if prepare is not None:
                    prepare(spare)
                group.spare = spare  # readers and casts see it only now, complete
                spares.append(spare)
        return spares

    def reads(self, index: int, step: int) -> Tensor:
        """The compute copy that training step ``step`` uploads from."""
        group = self.groups[index]
        return group.spare if group.spare is not None and step % 2 else group.compute

    def _refresh(self, group: FlatGroup, copy: bool = True) -> None:
        if copy and group.compute is not group.data:
            group.compute.copy_(group.data)
        group.synced_version = group.version()
        group.dirty = False

    def mark_dirty(self) -> None:
        """The masters changed in a way version counters miss (fused optimizer kernels do not bump them)."""
        for group in self.groups:
            group.dirty = group.compute is not group.data

    def sync_compute(self) -> int:
        """Refresh the compute copies whose master changed: marked dirty (after an optimizer step) or
        edited in place since (``load_state_dict``, a user's ``p.mul_``). Returns the groups copied.
        Synchronous mode, or before the first asynchronous step (it would overwrite the copies a
        pending update's staleness needs); spare copies take the masters too."""
        stale = [g for g in self.groups if g.compute is not g.data and (g.dirty or g.version() != g.synced_version)]
        for group in stale:
            self._refresh(group)
            if group.spare is not None:  # (nothing in flight: both copies take the masters)
                group.spare.copy_(group.compute)
        return len(stale)

    def release(self) -> None:
        """A closed engine's store: its compute copies, spares and gradients dropped, so that a store built anew
        over the same layers does not hold the host's memory twice (the masters are the parameters' storage)."""
        for group in self.groups:
            group.grad = group.spare = None
            group.compute = group.data

    def changed_trainable(self) -> list[int]:
        """Layers holding a parameter whose ``requires_grad`` is no longer what its group was built for (frozen or
        unfrozen since): their gradients, updates and memory were planned for the other."""
        return sorted({
            g.layer for g in self.groups if g.kind != "buffer" for t in g.members
            if isinstance(t, nn.Parameter) and t.requires_grad != g.trainable
        })  # fmt: skip

    def check_training(self) -> None:
        """Before a training batch: refuse :meth:`changed_trainable` layers (training on would silently keep the
        old set), and batch norms in training mode, whose running statistics the workers update on device copies
        the host never gets back."""
        if norms := sorted({i for i, m in self._running_statistics if m.training}):
            raise ValueError(
                f"roundpipe: layers {norms} hold batch norms in training mode, whose running statistics a forward"
                " updates in place; the workers run on device copies of them that never come back, and each"
                " micro-batch would normalise by its own statistics, so evaluation would use the initial ones."
                " Use LayerNorm or GroupNorm, track_running_stats=False, or keep them in eval mode (frozen"
                " statistics, as when fine-tuning with them frozen): module.eval() after Lightning's train()."
            )
        if changed := self.changed_trainable():
            raise ValueError(
                f"roundpipe: parameters of layers {changed} were frozen or unfrozen (requires_grad changed) since the"
                " engine was built; its gradients, updates and memory are planned for the parameters trainable"
                " then, so it stops here rather than train the old set. Under Trainer the strategy builds the engine"
                " again for the new set between optimizer steps on one node (as BackboneFinetuning needs at an"
                " epoch's start): change requires_grad there, not in the middle of an accumulated step or with"
                " several nodes, or run the next phase as a new Trainer.fit."
            )

    def groups_of(self, layers: Iterable[int]) -> tuple[int, ...]:
        """Groups a set of layers reads, each once, in layer order (tied tensors may add another layer's)."""
        return tuple(dict.fromkeys(g for i in layers for g in self._layer_groups[i]))

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters)

    def nbytes(self) -> int:
        """Host bytes held for master weights, compute copies, buffers and gradients."""
        total = 0
        for g in self.groups:
            for t in (g.data, g.grad, g.spare) + (() if g.compute is g.data else (g.compute,)):
                if t is not None:
                    total += t.numel() * t.element_size()
        return total

    def install_grads(self) -> None:
        """Point every trainable ``p.grad`` at its slice of the host gradient buffer, so hooks, clipping
        and the optimizer see the pipeline's gradients."""
        for g in self.groups:
            assert g.grad is not None or not g.params
            for p, offset in g.params:
                p.grad = g.grad[offset : offset + p.numel()].view(p.shape)  # type: ignore[index]

    def clear_grads(self) -> None:
        """Start a new accumulation: the next write to each gradient group overwrites it (stale values are
        never read: a group no gradient reaches is zeroed by its first writer), and ``p.grad`` is unset."""
        for g in self.groups:
            for p, _ in g.params:
                p.grad = None
        self.fresh_grads = {g.index for g in self.groups if g.trainable}
