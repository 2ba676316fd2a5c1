"""Several nodes: one process per node on gloo, node 0's weights broadcast at the start, each gradient
group summed onto the node that owns it, which alone updates it (docs/multinode.md). With one node
every method here does nothing."""

from __future__ import annotations

import atexit
import os
import shlex
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _init_dist_connection

from lightning_roundpipe.engine import PipelineEngine
from lightning_roundpipe.runtime.exchange import NodeExchange

NOTICE_EVERY = 30.0
"""Seconds between the lines a node prints while it waits for the other nodes to join (tests shorten it)."""


def _destroy_groups() -> None:
    """At the process's exit, before the interpreter tears its objects down: the gloo groups destroyed in order.
    Left to the interpreter's teardown, a busy machine's node sometimes died there ('terminate called without an
    active exception', SIGABRT after its results were written), and torchrun's agent on the other node then
    waited at its exit barrier for 300 s."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


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
        with Rendezvous(cluster_environment, rank, self.count, timeout).waiting(NOTICE_EVERY):
            _init_dist_connection(cluster_environment, "gloo", rank, self.count, timeout=timeout)
            self._grad_group = dist.new_group(backend="gloo", timeout=timeout)
        atexit.register(_destroy_groups)  # (a later call finds them destroyed already)

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


class Rendezvous:
    """What a node waits for while the nodes' process group forms: said on stderr at once (every node, not
    only node 0), again every ``NOTICE_EVERY`` seconds until the group formed, and as a note on torch's
    error when it did not (issue 41: a second node never started used to mean 30 silent minutes)."""

    def __init__(self, environment: Any, rank: int, count: int, timeout: timedelta) -> None:
        self.rank, self.count, self.seconds = rank, count, timeout.total_seconds()
        self.host, self.port = environment.main_address, environment.main_port  # a chosen port is kept
        self.address = f"{self.host}:{self.port}"
        self.manual = type(environment).__name__ == "LightningEnvironment"  # no launcher: started by hand
        self.launcher = type(environment).__name__
        spans = [(a, b) for a, b in ((0, rank - 1), (rank + 1, count - 1)) if b >= a]
        self.others = " and ".join(str(a) if a == b else f"{a}..{b}" for a, b in spans)
        self.first_other = 1 if rank == 0 else 0

    def first(self) -> str:
        lines = [
            f"roundpipe: node {self.rank} of {self.count} (NODE_RANK={self.rank}) is waiting for the other nodes"
            f" (NODE_RANK {self.others}) to join at {self.address} (MASTER_ADDR:MASTER_PORT, where node 0"
            f" listens): {self.count} processes in all, one per node."
        ]
        if self.manual:
            example = f"MASTER_ADDR={self.host} MASTER_PORT={self.port} NODE_RANK={self.first_other}"
            lines.append(
                "  Start the same command on each other node with the same MASTER_ADDR and MASTER_PORT and its own"
                f" NODE_RANK, e.g. `{example} {shlex.join(sys.orig_argv)}`, or start"
                f" every node through torchrun (--nnodes {self.count} --nproc_per_node 1 --node_rank R) or srun"
                " (one task per node)."
            )
            lines += self._unset()
        else:
            lines.append(
                f"  This process was started through a launcher ({self.launcher}): check that it started the other"
                f" nodes too (torchrun --nnodes {self.count} on each node, or srun with one task per node)."
            )
        lines.append(
            f"  It gives up after {self.seconds:g} s and fails; see 'Waiting for the other nodes' in docs/multinode.md."
        )
        return "\n".join(lines)

    def _unset(self) -> list[str]:
        """Hints for the variables a manual start left unset (read before Lightning sets MASTER_*)."""
        hints = []
        if "MASTER_ADDR" not in os.environ:
            hints.append(f"MASTER_ADDR is not set, so {self.host}: set it to node 0's address on every node.")
        if "MASTER_PORT" not in os.environ:
            hints.append(
                f"MASTER_PORT is not set, so a free port ({self.port}) the others cannot know: set one on every node."
            )
        if "NODE_RANK" not in os.environ and "GROUP_RANK" not in os.environ:
            hints.append("NODE_RANK is not set, so this is node 0: give each node its own.")
        return [f"  {hint}" for hint in hints]

    def again(self, waited: float) -> str:
        return (
            f"roundpipe: node {self.rank} of {self.count} still waiting for the other nodes (NODE_RANK {self.others})"
            f" at {self.address}: {waited:.0f} s so far, gives up after about {self.seconds:g} s (docs/multinode.md)."
        )

    def note(self, waited: float) -> str:
        return (
            f"roundpipe: node {self.rank} of {self.count} waited {waited:.0f} s (RoundPipeStrategy(timeout="
            f"{self.seconds:g})) for the other nodes (NODE_RANK {self.others}, {self.count} processes in all) at"
            f" {self.address}. Were they started, with the same MASTER_ADDR and MASTER_PORT and their own NODE_RANK"
            " (or through torchrun or srun)? See 'Waiting for the other nodes' in docs/multinode.md."
        )

    @contextmanager
    def waiting(self, every: float) -> Iterator[None]:
        """Says what this node waits for, repeats it every ``every`` seconds from a daemon thread while the
        body runs, stops once the body ends (joined: no line comes after), adds the note to its error."""
        started, done, reminded = time.monotonic(), threading.Event(), threading.Event()

        def remind() -> None:
            while not done.wait(every):
                _say(self.again(time.monotonic() - started))
                reminded.set()

        _say(self.first())
        thread = threading.Thread(target=remind, name="roundpipe-rendezvous", daemon=True)
        thread.start()
        try:
            yield
        except Exception as error:
            error.add_note(self.note(time.monotonic() - started))
            raise
        finally:
            done.set()
            thread.join(timeout=10)
        if reminded.is_set():
            _say(
                f"roundpipe: node {self.rank}: all {self.count} nodes joined after {time.monotonic() - started:.0f} s."
            )


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
