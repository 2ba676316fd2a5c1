"""Data parallelism across nodes: one process per node (gloo on this machine), each running roundpipe on
2 CPU workers; weights equal one process over the same global batches."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import BoringPipeline, boring_data, fit, flat_weights, relative_error
from torch.utils.data import DataLoader, Sampler

from lightning_roundpipe import RoundPipeStrategy

HERE = Path(__file__).resolve().parent


class EpochPermutation(Sampler[int]):
    """The permutation Lightning's ``DistributedSampler`` draws in an epoch (seeded with the global seed
    plus the epoch), undivided: global batch k is what the nodes' k-th batches hold together."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        g = torch.Generator().manual_seed(1 + self.epoch)  # seed_everything(1) in both runs
        return iter(torch.randperm(self.n, generator=g).tolist())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nodes(tmp_path: Path, num_nodes: int, mode: str, batch_size: int, epochs: int, *extra: str) -> list:
    port = free_port()
    procs = []
    for rank in range(num_nodes):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": str(rank),
               "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
        for key in ("LOCAL_RANK", "WORLD_SIZE", "RANK", "GROUP_RANK"):
            env.pop(key, None)
        out = tmp_path / f"node{rank}.pt"
        cmd = [sys.executable, str(HERE / "node_run.py"), str(out), str(num_nodes), mode, str(batch_size), str(epochs)]
        procs.append((subprocess.Popen([*cmd, *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True), out))  # fmt: skip
    return procs


def launch_nodes(tmp_path: Path, num_nodes: int, mode: str, batch_size: int, epochs: int) -> list[dict]:
    procs = start_nodes(tmp_path, num_nodes, mode, batch_size, epochs)
    results = []
    for proc, out in procs:
        log, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, log[-3000:]
        results.append(torch.load(out))
    return results


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_nodes_equal_one_process_over_the_same_global_batches(tmp_path, mode):
    nodes = launch_nodes(tmp_path, 2, mode, batch_size=6, epochs=2)
    assert [n["rank"] for n in nodes] == [0, 1] and all(n["world_size"] == 2 for n in nodes), nodes
    assert nodes[0]["sampler"] == ("DistributedSampler", True)  # Lightning put in the strategy's sampler
    assert torch.equal(nodes[0]["weights"], nodes[1]["weights"])  # the nodes stay in step
    # one process, batches of 12: the samples both nodes drew in that step (DistributedSampler's permutation)
    strategy = RoundPipeStrategy(num_microbatches=3, async_optimizer=mode == "async")
    trainer_kwargs = {"accelerator": "cpu", "devices": 2, "strategy": strategy, "max_epochs": 2}
    dataset = boring_data().dataset
    single = fit(BoringPipeline, trainer_kwargs, data=DataLoader(dataset, batch_size=12, sampler=EpochPermutation(96)))
    assert relative_error(nodes[0]["weights"], flat_weights(single)) <= 1e-5


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_node_that_dies_makes_the_other_fail_instead_of_hanging(tmp_path, mode):
    import time

    procs = start_nodes(tmp_path, 2, mode, 6, 2, "3", "1")  # node 1 ends abruptly at step 3
    start = time.monotonic()
    (survivor, _), (dead, _) = procs
    dead.wait(timeout=120)
    log, _ = survivor.communicate(timeout=120)
    assert dead.returncode == 3
    assert survivor.returncode != 0, log[-2000:]
    assert time.monotonic() - start < 120
    assert "Connection" in log or "connection" in log or "peer" in log, log[-2000:]
