"""One process per node, driving every device of its node: the host as root device, the worker devices,
ranks, world size, sampler and collectives between nodes (no launcher, no process per GPU)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.utilities.distributed import (
    _all_gather_ddp_if_available,
    _distributed_is_initialized,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.rank_zero import rank_zero_only as _fabric_rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_roundpipe._flavor import lightning_package
from lightning_roundpipe.nodes import Nodes

pl = lightning_package(globals())
_rank_zero_only = pl.utilities.rank_zero_only


class _NodeProcesses(pl.strategies.ParallelStrategy):  # type: ignore[misc,name-defined]
    """A ``ParallelStrategy`` with one process per node: the model stays on the host (the root device) and
    the node's devices are workers; world size and global rank count nodes, the distributed sampler
    splits data over nodes, and collectives run on gloo between nodes. Its name is private so that
    LightningCLI's list of strategies (jsonargparse leaves out private class paths) shows only
    ``RoundPipeStrategy``, which users pick; ``NodeProcesses`` is the name the package uses."""

    def __init__(self, timeout: timedelta, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._nodes = Nodes()
        self._timeout = timeout

    @property
    @override
    def root_device(self) -> torch.device:
        """The host: the model, optimizer and batches live there; workers bring data to devices."""
        return torch.device("cpu")

    @property
    def worker_devices(self) -> list[torch.device]:
        return list(self.parallel_devices or [torch.device("cpu")])

    @override
    def setup_environment(self) -> None:
        assert self.accelerator is not None
        self.accelerator.setup_device(self.worker_devices[0])
        if self._nodes.count > 1:  # set the ranks and join the nodes' process groups
            assert self.cluster_environment is not None
            _rank_zero_only.rank = _fabric_rank_zero_only.rank = self.node_rank
            self._nodes.connect(self.cluster_environment, self.node_rank, self._timeout)

    @override
    def model_to_device(self) -> None:
        """The model stays on the host: the engine moves weights to devices stage by stage."""

    @property
    def is_distributed(self) -> bool:
        """Several nodes: one process per node, data parallel across them."""
        return self._nodes.count > 1

    @property
    @override
    def world_size(self) -> int:
        return self._nodes.count

    @property
    @override
    def global_rank(self) -> int:
        return self.node_rank

    @property
    @override
    def local_rank(self) -> int:
        return 0

    @property
    @override
    def node_rank(self) -> int:
        if self._nodes.count == 1 or self.cluster_environment is None:
            return 0
        return self.cluster_environment.node_rank()

    @property
    def num_nodes(self) -> int:
        return self._nodes.count

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        if num_nodes < 1:
            raise ValueError(f"`Trainer(strategy='roundpipe', num_nodes={num_nodes})` must be at least 1")
        self._nodes.count = num_nodes

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:
        return None if self._nodes.count == 1 else {"num_replicas": self._nodes.count, "rank": self.node_rank}

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op) if isinstance(tensor, Tensor) else tensor

    @override
    def barrier(self, name: str | None = None) -> None:
        if _distributed_is_initialized():
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src)
        return box[0]

    @override
    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        return _all_gather_ddp_if_available(tensor, group=group, sync_grads=sync_grads)


NodeProcesses = _NodeProcesses
