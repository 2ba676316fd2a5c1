"""Gradients and weights between nodes, with optimizer states sharded across them (ZeRO-1 style).

Each trainable flat group has an owner node (groups dealt out largest first to the least-loaded
node). Per optimizer step a group's gradient is summed onto its owner (``reduce``), the owner alone
updates the group, so only it ever holds the group's optimizer state, and then broadcasts the new
master weights to the others. Bytes per node and step are those of an all-reduce; optimizer-state
memory is divided by the number of nodes. Every node issues the collectives in the same group
order, so they pair up; they run on a process group of their own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_roundpipe.runtime.host_store import HostStore


def assign_owners(sizes: dict[int, int], nodes: int) -> dict[int, int]:
    """Group -> node, largest groups first onto the node holding the fewest elements so far."""
    load = [0] * nodes
    owners = {}
    for g in sorted(sizes, key=lambda g: (-sizes[g], g)):
        node = min(range(nodes), key=lambda n: (load[n], n))
        owners[g] = node
        load[node] += sizes[g]
    return owners


class NodeExchange:
    """The store's trainable groups split among ``nodes`` processes of ``process_group``."""

    def __init__(self, store: HostStore, process_group: Any, rank: int, nodes: int) -> None:
        self.store = store
        self.group = process_group
        self.rank = rank
        self.nodes = nodes
        sizes = {g.index: g.data.numel() for g in store.groups if g.trainable}
        self.owner = assign_owners(sizes, nodes)

    def owns(self, g: int) -> bool:
        return self.owner[g] == self.rank

    @property
    def owned(self) -> list[int]:
        return [g for g in self.owner if self.owns(g)]

    def _grad(self, g: int) -> Tensor:
        grad = self.store.groups[g].grad
        assert grad is not None
        return grad

    def reduce(self, g: int) -> None:
        """Sum group ``g``'s gradient onto its owner, which then holds the mean over nodes."""
        grad = self._grad(g)
        dist.reduce(grad, dst=dist.get_global_rank(self.group, self.owner[g]), group=self.group)
        if self.owns(g):
            grad.div_(self.nodes)

    def reduce_all(self, groups: Iterable[int] | None = None) -> None:
        for g in self.owner if groups is None else groups:
            self.reduce(g)

    def global_norm(self) -> float:
        """The 2-norm of the whole (averaged) gradient: each owner's part, summed over nodes."""
        local = sum(float(torch.linalg.vector_norm(self._grad(g)).double()) ** 2 for g in self.owned)
        total = torch.tensor([local], dtype=torch.float64)
        dist.all_reduce(total, group=self.group)
        return math.sqrt(float(total.item()))

    def clip_norm(self, max_norm: float) -> None:
        """Scale the owned gradients so the global norm is at most ``max_norm`` (as plain clipping would)."""
        coefficient = min(1.0, max_norm / (self.global_norm() + 1e-6))
        if coefficient < 1.0:
            for g in self.owned:
                self._grad(g).mul_(coefficient)

    def drop_foreign_grads(self) -> None:
        """Unset ``p.grad`` of parameters another node updates: the optimizer skips them and never makes
        state for them."""
        for g, owner in self.owner.items():
            if owner != self.rank:
                for p, _ in self.store.groups[g].params:
                    p.grad = None

    def broadcast(self, g: int) -> None:
        """Group ``g``'s master weights from its owner to every node."""
        dist.broadcast(self.store.groups[g].data, src=dist.get_global_rank(self.group, self.owner[g]), group=self.group)

    def broadcast_all(self, groups: Iterable[int] | None = None) -> None:
        for g in self.owner if groups is None else groups:
            self.broadcast(g)
