"""Data parallelism across nodes: one process per node (gloo on this machine), each running roundpipe on
2 CPU workers; weights equal one process over the same global batches."""

from __future__ import annotations

import json
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
    servers: list,
    tmp_path: Path,
    num_nodes: int,
    mode: str,
    batch_size: int,
    epochs: int,
    *extra: str,
    clip: float = 0.0,
    env_extra: dict[str, str] | None = None,
    runs: Path | None = None,
) -> list:
    """One ``node_run.py`` process per node, node ``r`` a child of ``servers[r]`` (the ``prewarmed`` fixture:
    it starts with torch and Lightning imported); its output, stdout and stderr together, in ``node{r}.log``.
    One fit, or with ``runs`` the fits that JSON file lists, one after another (``mode`` and ``epochs`` are
    then the runs')."""
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
        if runs is not None:
            cmd = [sys.executable, str(HERE / "node_run.py"), "--runs", str(runs), str(num_nodes), str(batch_size)]
        log = tmp_path / f"node{rank}.log"
        procs.append((servers[rank].popen([*cmd[1:], *extra], env=env, cwd=os.getcwd(), stdout=log), out))
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


def launch_runs(servers: list, folder: Path, runs: dict[str, dict]) -> dict[str, list]:
    """Two nodes of batches of 6 that fit ``runs`` (name: ``node_run.py --runs`` entry, without ``out``) one
    after another in the same two processes; per run, what each node wrote."""
    folder.mkdir(parents=True, exist_ok=True)
    listed = [{**run, "out": str(folder / f"{name}-node{{rank}}.pt")} for name, run in runs.items()]
    (folder / "runs.json").write_text(json.dumps(listed))
    procs = start_nodes(servers, folder, 2, "", 6, 0, runs=folder / "runs.json")
    try:
        for proc, _ in procs:
            log, _ = proc.communicate(timeout=240)
            assert proc.returncode == 0, log[-3000:]
    finally:
        kill_all([proc for proc, _ in procs])
    return {name: [torch.load(folder / f"{name}-node{rank}.pt") for rank in range(2)] for name in runs}


EQUAL_CASES = [("sync", 0.0, "32-true"), ("async", 0.0, "32-true"), ("sync", 0.05, "32-true"),
               ("async", 0.05, "32-true"), ("async", 0.0, "bf16-true")]  # fmt: skip


class TwoNodeRuns:
    """The two-node fits of this module's selected equality and resume tests, run when the first of them asks:
    every 2-epoch fit and every 1-epoch fit that saves a checkpoint in one pair of processes, then the fits
    resuming from those checkpoints in a second pair (11 pairs of processes before, each with its start-up
    and process group). The fits are what they were, each with its own module, strategy and Trainer, seeded
    alike, and each test checks its own; the resume tests' uninterrupted run is the equality test's fit
    without clipping, and they resume in processes other than those that saved."""

    def __init__(self, servers: list, folder: Path, cases: list[tuple], resume_modes: list[str]) -> None:
        self.servers, self.folder, self.resume_modes = servers, folder, resume_modes
        self.cases = list(dict.fromkeys([*cases, *[(mode, 0.0, "32-true") for mode in resume_modes]]))
        self._launched: dict[str, dict | BaseException] = {}

    @staticmethod
    def name(case: tuple) -> str:
        mode, clip, precision = case
        return f"{mode}-clip{clip}-{precision}"

    def checkpoint(self, mode: str) -> Path:
        self._launch("first")
        return self.folder / f"checkpoints-{mode}" / "epoch=0.ckpt"

    def fit(self, case: tuple) -> list:
        """What the two nodes wrote after 2 epochs of ``case`` (mode, clip, precision)."""
        return self._launch("first")[self.name(case)]

    def resumed(self, mode: str) -> list:
        """What the two nodes wrote after resuming ``mode``'s 1-epoch checkpoint for a second epoch."""
        self._launch("first")
        return self._launch("resumed")[f"resumed-{mode}"]

    def _launch(self, which: str) -> dict:
        if which not in self._launched:  # once: a failed launch fails every test that needs it, with its log
            if which == "first":
                runs = {self.name(case): {"mode": case[0], "epochs": 2, "clip": case[1], "precision": case[2]}
                        for case in self.cases}  # fmt: skip
                for mode in self.resume_modes:  # a first epoch that saves a checkpoint
                    runs[f"checkpointed-{mode}"] = {"mode": mode, "epochs": 1,
                                                    "ckpt_dir": str(self.folder / f"checkpoints-{mode}")}  # fmt: skip
            else:
                runs = {f"resumed-{mode}": {"mode": mode, "epochs": 2, "resume": str(self.checkpoint(mode))}
                        for mode in self.resume_modes}  # fmt: skip
            try:
                self._launched[which] = launch_runs(self.servers, self.folder / which, runs)
            except BaseException as failed:
                self._launched[which] = failed
        launched = self._launched[which]
        if isinstance(launched, BaseException):
            raise launched
        return launched


@pytest.fixture(scope="module")
def two_node_runs(request, tmp_path_factory, prewarmed):
    cases, resume_modes = [], []
    for item in request.session.items:
        if getattr(item, "module", None) is not request.module or not hasattr(item, "callspec"):
            continue
        params = item.callspec.params
        if item.originalname == "test_two_nodes_equal_one_process_over_the_same_global_batches":
            cases.append((params["mode"], params["clip"], params["precision"]))
        elif item.originalname == "test_two_nodes_resume_exactly_from_a_checkpoint_with_sharded_optimizer_states":
            resume_modes.append(params["mode"])
    return TwoNodeRuns(prewarmed, tmp_path_factory.mktemp("two-node-runs"), cases, resume_modes)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode, clip, precision", EQUAL_CASES)
def test_two_nodes_equal_one_process_over_the_same_global_batches(two_node_runs, mode, clip, precision):
    """bf16-true: bf16 gradients reduced over gloo, bf16 optimizer states sharded. The nodes fit in batches
    of 6 for 2 epochs (``TwoNodeRuns``: the five cases one after another in one pair of processes)."""
    nodes = two_node_runs.fit((mode, clip, precision))
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
def test_a_node_that_dies_makes_the_other_fail_instead_of_hanging(tmp_path, prewarmed):
    """Both optimizer modes at once: two independent pairs of nodes, so their start-ups overlap."""
    import time

    start = time.monotonic()
    pairs = {mode: start_nodes(prewarmed, tmp_path / mode, 2, mode, 6, 2, "3", "1") for mode in ("sync", "async")}
    try:  # node 1 ends abruptly at step 3
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
def test_a_node_that_hangs_makes_the_other_fail_after_the_timeout(tmp_path, prewarmed):
    """Both optimizer modes at once: the timeout each survivor waits out would otherwise come twice. The two
    nodes of a pair start together (``START_TOGETHER``: each waits, once it has imported what it needs, for
    the other), so the timeout bounds only the exchanges of training up to the hang, not how much later one
    of four processes got there on a busy 2-core machine: 8 s of them instead of 20."""
    import time

    hang = {"HANG_RANK": "1", "HANG_AT": "3", "PG_TIMEOUT": "8"}
    start = time.monotonic()
    pairs = {
        mode: start_nodes(prewarmed, tmp_path / mode, 2, mode, 6, 2,
                          env_extra={**hang, "START_TOGETHER": str(tmp_path / mode / "started")})
        for mode in ("sync", "async")
    }  # fmt: skip
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
def test_two_nodes_resume_exactly_from_a_checkpoint_with_sharded_optimizer_states(two_node_runs, mode):
    """2 epochs straight; 1 epoch that saves a checkpoint; from it, the second epoch in new processes (batches
    of 6, ``TwoNodeRuns``)."""
    straight = two_node_runs.fit((mode, 0.0, "32-true"))
    checkpoint = two_node_runs.checkpoint(mode)
    saved = torch.load(checkpoint, weights_only=False)
    assert len(saved["optimizer_states"][0]["state"]) == len(list(BoringPipeline().parameters()))  # gathered
    resumed = two_node_runs.resumed(mode)
    assert relative_error(resumed[0]["weights"], straight[0]["weights"]) <= 1e-6
    assert resumed[0]["optimizer_state"] and not set(resumed[0]["optimizer_state"]) & set(resumed[1]["optimizer_state"])


@pytest.mark.timeout(120)
def test_nodes_with_different_models_are_refused(tmp_path, prewarmed):
    procs = start_nodes(prewarmed, tmp_path, 2, "sync", 6, 1, env_extra={"WIDTH": "20", "WIDTH_RANK": "1"})
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
