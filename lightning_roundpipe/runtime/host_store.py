"""Host store: the model's master weights and gradients, packed into flat host buffers per layer.

Every parameter and buffer of a layer moves into one contiguous buffer per (dtype, trainable) group,
and the module's own tensors become views into it. The LightningModule and its optimizer keep
working on the very same ``nn.Parameter`` objects, while a stage's weights travel as a few large
copies. Trainable groups get a gradient buffer of the same layout; frozen parameters and module
buffers get none.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

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
    """One contiguous host buffer holding tensors of one layer that share dtype and trainability."""

    index: int
    layer: int
    trainable: bool
    data: Tensor
    grad: Tensor | None
    params: list[tuple[nn.Parameter, int]] = field(default_factory=list)
    """Trainable parameters in this group and their offsets, to point ``p.grad`` into ``grad``."""


class HostStore:
    """Master weights and gradients of a layer sequence, in flat host buffers."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self.num_layers = len(layers)
        self.groups: list[FlatGroup] = []
        self.layer_tensors: list[tuple[TensorRef, ...]] = []
        self._layer_groups: list[tuple[int, ...]] = []
        self.parameters: list[nn.Parameter] = []
        pending: dict[tuple[int, torch.dtype, bool], list[Tensor]] = {}
        named: list[list[tuple[str, Tensor]]] = []
        seen: set[int] = set()
        for i, layer in enumerate(layers):
            tensors = list(layer.named_parameters(remove_duplicate=False))
            tensors += list(layer.named_buffers(remove_duplicate=False))
            named.append(tensors)
            for _, t in tensors:
                if id(t) not in seen:
                    seen.add(id(t))
                    if isinstance(t, nn.Parameter):
                        self.parameters.append(t)
                    trainable = isinstance(t, nn.Parameter) and t.requires_grad
                    pending.setdefault((i, t.dtype, trainable), []).append(t)
        placed: dict[int, TensorRef] = {}
        for (layer_index, dtype, trainable), tensors in pending.items():
            placed.update(self._pack(layer_index, dtype, trainable, tensors))
        for tensors in named:
            refs = tuple(
                TensorRef(name, placed[id(t)].group, placed[id(t)].offset, placed[id(t)].shape) for name, t in tensors
            )
            self.layer_tensors.append(refs)
            self._layer_groups.append(tuple(dict.fromkeys(r.group for r in refs)))

    def _pack(self, layer: int, dtype: torch.dtype, trainable: bool, tensors: list[Tensor]) -> dict[int, TensorRef]:
        """Copy ``tensors`` into one new flat buffer and make them views of it."""
        refs: dict[int, TensorRef] = {}
        total = sum(t.numel() for t in tensors)
        data = torch.empty(total, dtype=dtype)
        group = FlatGroup(len(self.groups), layer, trainable, data, torch.zeros_like(data) if trainable else None)
        self.groups.append(group)
        offset = 0
        for t in tensors:
            n = t.numel()
            view = data[offset : offset + n]
            view.copy_(t.detach().reshape(-1))
            t.data = view.view(t.shape)
            if trainable:
                assert isinstance(t, nn.Parameter)
                group.params.append((t, offset))
            refs[id(t)] = TensorRef("", group.index, offset, t.shape)
            offset += n
        return refs

    def groups_of(self, layers: Iterable[int]) -> tuple[int, ...]:
        """Groups a set of layers reads, each once, in layer order (tied tensors may add another layer's)."""
        return tuple(dict.fromkeys(g for i in layers for g in self._layer_groups[i]))

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters)

    def nbytes(self) -> int:
        """Host bytes held for weights, buffers and gradients."""
        total = 0
        for g in self.groups:
            total += g.data.numel() * g.data.element_size()
            if g.grad is not None:
                total += g.grad.numel() * g.grad.element_size()
        return total

    def install_grads(self) -> None:
        """Point every trainable ``p.grad`` at its slice of the host gradient buffer, so hooks, clipping
        and the optimizer see the pipeline's gradients."""
        for g in self.groups:
            assert g.grad is not None or not g.params
            for p, offset in g.params:
                p.grad = g.grad[offset : offset + p.numel()].view(p.shape)  # type: ignore[index]

    def clear_grads(self) -> None:
        """Zero the host gradients after they were used, and detach them from the parameters."""
        for g in self.groups:
            if g.grad is not None:
                g.grad.zero_()
            for p, _ in g.params:
                p.grad = None
