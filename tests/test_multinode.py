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


def start_nodes(
    tmp_path: Path,
    num_nodes: int,
    mode: str,
    batch_size: int,
    epochs: int,
    *extra: str,
    clip: float = 0.0,
    env_extra: dict[str, str] | None = None,
) -> list:
    env_extra = env_extra or {}
    tmp_path.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(num_nodes):
        path = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": str(rank),
               "PYTHONPATH": path, "CLIP": str(clip), **env_extra}  # fmt: skip
        for key in ("LOCAL_RANK", "WORLD_SIZE", "RANK", "GROUP_RANK"):
            env.pop(key, None)
        out = tmp_path / f"node{rank}.pt"
        cmd = [sys.executable, str(HERE / "node_run.py"), str(out), str(num_nodes), mode, str(batch_size), str(epochs)]
        procs.append((subprocess.Popen([*cmd, *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True), out))  # fmt: skip
    return procs


def kill_all(procs: list) -> None:
    """No node outlives its test, whatever the test asserted (killed, then reaped)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()  # its output stays in the pipe for a later communicate()


def left(deadline: float) -> float:
    """Seconds to the test's own deadline: a slow node fails it with ``TimeoutExpired`` (and the other
    nodes killed), before pytest-timeout's limit would end it without a word."""
    import time

    return max(1.0, deadline - time.monotonic())


def launch_nodes(
    tmp_path: Path, num_nodes: int, mode: str, batch_size: int, epochs: int, clip: float = 0.0, **env: str
) -> list:
    procs = start_nodes(tmp_path, num_nodes, mode, batch_size, epochs, clip=clip, env_extra=env)
    results = []
    try:
        for proc, out in procs:
            log, _ = proc.communicate(timeout=240)
            assert proc.returncode == 0, log[-3000:]
            results.append(torch.load(out))
    finally:
        kill_all([proc for proc, _ in procs])
    return results


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "mode, clip, precision",
    [("sync", 0.0, "32-true"), ("async", 0.0, "32-true"), ("sync", 0.05, "32-true"), ("async", 0.05, "32-true"),
     ("async", 0.0, "bf16-true")],
)  # fmt: skip
def test_two_nodes_equal_one_process_over_the_same_global_batches(tmp_path, mode, clip, precision):
    """bf16-true: bf16 gradients reduced over gloo, bf16 optimizer states sharded."""
    nodes = launch_nodes(tmp_path, 2, mode, batch_size=6, epochs=2, clip=clip, PRECISION=precision)
    assert [n["rank"] for n in nodes] == [0, 1] and all(n["world_size"] == 2 for n in nodes), nodes
    assert nodes[0]["sampler"] == ("DistributedSampler", True)  # Lightning put in the strategy's sampler
    assert nodes[0]["logged"] == nodes[1]["logged"] == 0.5  # self.log(..., sync_dist=True) averages nodes
    assert torch.equal(nodes[0]["weights"], nodes[1]["weights"])  # the nodes stay in step
    # one process, batches of 12: the samples both nodes drew in that step (DistributedSampler's permutation)
    strategy = RoundPipeStrategy(num_microbatches=3, async_optimizer=mode == "async")
    trainer_kwargs = {"accelerator": "cpu", "devices": 2, "strategy": strategy, "max_epochs": 2, "precision": precision}
    if clip:
        trainer_kwargs["gradient_clip_val"] = clip
    dataset = boring_data().dataset
    single = fit(BoringPipeline, trainer_kwargs, data=DataLoader(dataset, batch_size=12, sampler=EpochPermutation(96)))
    tolerance = 1e-5 if precision == "32-true" else 2e-2  # bf16: the nodes' sum and mean round in bf16
    assert relative_error(nodes[0]["weights"], flat_weights(single)) <= tolerance
    assert nodes[0]["weights"].dtype == (torch.bfloat16 if precision == "bf16-true" else torch.float32)
    # optimizer states are sharded: each node keeps those of the groups it updates, together all of them
    shards = [set(n["optimizer_state"]) for n in nodes]
    assert shards[0] and shards[1] and not shards[0] & shards[1]
    assert shards[0] | shards[1] == {name for name, _ in BoringPipeline().named_parameters()}


@pytest.mark.timeout(300)
def test_a_node_that_dies_makes_the_other_fail_instead_of_hanging(tmp_path):
    """Both optimizer modes at once: two independent pairs of nodes, so their start-ups overlap."""
    import time

    start = time.monotonic()
    pairs = {mode: start_nodes(tmp_path / mode, 2, mode, 6, 2, "3", "1") for mode in ("sync", "async")}  # node 1
    try:  # ends abruptly at step 3
        for mode, ((survivor, _), (dead, _)) in pairs.items():
            dead.wait(timeout=left(start + 240))
            log, _ = survivor.communicate(timeout=left(start + 240))
            assert dead.returncode == 3, mode
            assert survivor.returncode != 0, (mode, log[-2000:])
            assert "Connection" in log or "connection" in log or "peer" in log, (mode, log[-2000:])
    finally:
        kill_all([proc for procs in pairs.values() for proc, _ in procs])
    assert time.monotonic() - start < 120


@pytest.mark.timeout(200)
def test_a_node_that_hangs_makes_the_other_fail_after_the_timeout(tmp_path):
    """Both optimizer modes at once: the 20 s each survivor waits out would otherwise come twice. 20 s also
    bounds start-up and every exchange before the hang: room for four processes on a busy 2-core machine."""
    import time

    hang = {"HANG_RANK": "1", "HANG_AT": "3", "PG_TIMEOUT": "20"}
    start = time.monotonic()
    pairs = {mode: start_nodes(tmp_path / mode, 2, mode, 6, 2, env_extra=hang) for mode in ("sync", "async")}
    logs = {}
    try:
        for mode, ((survivor, _), _) in pairs.items():  # well before the stuck nodes' 120 s sleep ends
            logs[mode] = survivor.communicate(timeout=left(start + 110))[0]
    finally:
        kill_all([proc for procs in pairs.values() for proc, _ in procs])
    for mode, ((survivor, _), (stuck, _)) in pairs.items():
        stuck_log, _ = stuck.communicate()
        assert "node 1 hangs at step 3" in stuck_log, (mode, stuck_log[-2000:])  # not a start-up timeout
        assert survivor.returncode != 0, (mode, logs[mode][-2000:])
        assert "imed out" in logs[mode] or "timeout" in logs[mode].lower(), (mode, logs[mode][-2000:])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_nodes_resume_exactly_from_a_checkpoint_with_sharded_optimizer_states(tmp_path, mode):
    straight = launch_nodes(tmp_path / "a", 2, mode, 6, 2)
    launch_nodes(tmp_path / "b", 2, mode, 6, 1, CKPT_DIR=str(tmp_path / "ckpt"))
    checkpoint = tmp_path / "ckpt" / "epoch=0.ckpt"
    saved = torch.load(checkpoint, weights_only=False)
    assert len(saved["optimizer_states"][0]["state"]) == len(list(BoringPipeline().parameters()))  # gathered
    resumed = launch_nodes(tmp_path / "c", 2, mode, 6, 2, RESUME=str(checkpoint))
    assert relative_error(resumed[0]["weights"], straight[0]["weights"]) <= 1e-6
    assert resumed[0]["optimizer_state"] and not set(resumed[0]["optimizer_state"]) & set(resumed[1]["optimizer_state"])


@pytest.mark.timeout(120)
def test_nodes_with_different_models_are_refused(tmp_path):
    procs = start_nodes(tmp_path, 2, "sync", 6, 1, env_extra={"WIDTH": "20", "WIDTH_RANK": "1"})
    try:
        for proc, _ in procs:
            log, _ = proc.communicate(timeout=100)
            assert proc.returncode != 0
            assert "node 1's model differs from node 0's" in log, log[-2000:]
    finally:
        kill_all([proc for proc, _ in procs])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", ["torchrun", "slurm"])
def test_launch_with_torchrun_or_under_slurm_one_process_per_node(tmp_path, launcher):
    """The launch recipes of docs/multinode.md: torchrun with one process per node; SLURM with one task
    per node (its variables set as srun sets them)."""
    import random

    port, job = free_port(), random.randrange(10**6)
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if k not in ("NODE_RANK", "MASTER_ADDR", "MASTER_PORT")}
        env["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
        args = [str(HERE / "node_run.py"), str(tmp_path / f"node{rank}.pt"), "2", "sync", "6", "1"]
        if launcher == "torchrun":
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1"]
            cmd = [*torchrun, "--node_rank", str(rank), "--master_addr", "127.0.0.1", "--master_port", str(port), *args]
        else:
            env.update(SLURM_NODELIST="localhost", SLURM_JOB_ID=str(job), SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="1",
                       SLURM_NNODES="2", SLURM_PROCID=str(rank), SLURM_NODEID=str(rank), SLURM_LOCALID="0",
                       SLURM_JOB_NAME="train")  # fmt: skip
            cmd = [sys.executable, *args]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for proc in procs:
        log, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, log[-3000:]
    nodes = [torch.load(tmp_path / f"node{rank}.pt") for rank in range(2)]
    assert [n["rank"] for n in nodes] == [0, 1] and nodes[0]["world_size"] == 2
    assert torch.equal(nodes[0]["weights"], nodes[1]["weights"]) and nodes[0]["logged"] == 0.5
    assert not set(nodes[0]["optimizer_state"]) & set(nodes[1]["optimizer_state"])
