"""Several nodes: one process per node on gloo, node 0's weights broadcast at the start, each gradient
group summed onto the node that owns it, which alone updates it (docs/multinode.md). With one node
every method here does nothing."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _init_dist_connection

from lightning_roundpipe.engine import PipelineEngine
from lightning_roundpipe.runtime.exchange import NodeExchange


class Nodes:
    """This process's place among the nodes, and the gradient exchange once the engine exists."""

    def __init__(self) -> None:
        self.count = 1
        self.rank = 0
        self.exchange: NodeExchange | None = None
        self._grad_group: Any = None

    def connect(self, cluster_environment: Any, rank: int, timeout: timedelta) -> None:
        """Join a gloo process group (host tensors are what nodes exchange), plus a second group for the
        gradients the optimizer thread reduces, so they never interleave with the main thread's
        collectives (metrics, barriers)."""
        self.rank = rank
        cluster_environment.set_global_rank(rank)
        cluster_environment.set_world_size(self.count)
        _init_dist_connection(cluster_environment, "gloo", rank, self.count, timeout=timeout)
        self._grad_group = dist.new_group(backend="gloo", timeout=timeout)

    def join(self, engine: PipelineEngine, asynchronous: bool) -> None:
        """Start from node 0's weights and wire the exchange: the optimizer thread's (asynchronous) or
        the strategy's around the optimizer step (synchronous)."""
        if self.count == 1:
            return
        self._broadcast_weights(engine)
        self.exchange = NodeExchange(engine.store, self._grad_group, self.rank, self.count)
        if asynchronous:
            engine.use_exchange(self.exchange)

    def _broadcast_weights(self, engine: PipelineEngine) -> None:
        """Every node starts from node 0's weights and buffers, as DDP does (after checking that every
        node holds the same model: a mismatch would otherwise pair collectives of different sizes)."""
        mine = [(g.kind, str(g.data.dtype), g.data.numel()) for g in engine.store.groups]
        everyone: list[Any] = [None] * self.count
        dist.all_gather_object(everyone, mine)
        for rank, theirs in enumerate(everyone):
            if theirs != everyone[0]:
                pairs = zip(theirs, everyone[0])
                first = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(theirs), len(everyone[0])))
                raise ValueError(
                    f"node {rank}'s model differs from node 0's ({len(theirs)} vs {len(everyone[0])} flat groups,"
                    f" first difference at group {first}). Every node must build the same model with the same"
                    " trainable parameters."
                )
        for group in engine.store.groups:
            dist.broadcast(group.data, 0)
        engine.store.mark_dirty()
        engine.store.sync_compute()

    def all_finite(self, finite: bool) -> bool:
        """Whether the loss was finite on every node: all must stop on the same step, or the others wait
        in the gradient exchange."""
        if self.count == 1:
            return finite
        flag = torch.tensor([1.0 if finite else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def step_closure(self, closure: Callable[[], Any], clip_value: float | None, clip_algorithm: Any) -> Callable:
        """Synchronous mode: the optimizer closure with the gradients sent to their owners and clipped over
        all nodes before the step, which then updates (and keeps state for) this node's groups only."""
        exchange = self.exchange
        if exchange is None:
            return closure

        def reduced() -> Any:
            result = closure()
            exchange.reduce_all()
            if clip_value and clip_algorithm in (None, "norm"):
                exchange.clip_norm(float(clip_value))  # Lightning's own clip is then a no-op
            exchange.drop_foreign_grads()
            return result

        return reduced

    def after_step(self) -> None:
        """Synchronous mode: every node's masters get the groups their owners updated."""
        if self.exchange is not None:
            self.exchange.broadcast_all()

    def keep_own_states(self, optimizers: list[Any], engine: PipelineEngine) -> None:
        """After a checkpoint's optimizer state was loaded: keep only the states of this node's groups."""
        if self.exchange is None:
            return
        for optimizer in optimizers:
            for g, owner in self.exchange.owner.items():
                if owner != self.rank:
                    for p, _ in engine.store.groups[g].params:
                        optimizer.state.pop(p, None)

    def gather_states(self, state: dict[str, Any]) -> dict[str, Any]:
        """An optimizer state dict with every node's per-parameter states (a collective)."""
        if self.exchange is None:
            return state
        shards: list[Any] = [None] * self.count
        dist.all_gather_object(shards, state["state"])
        return {**state, "state": {k: v for shard in shards for k, v in shard.items()}}
