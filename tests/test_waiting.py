"""Issue 41: a node started without the others says at once what it waits for (node count, address and
port, its rank, how to start the others, how long it waits), repeats a short line while it waits, and
fails after the strategy's ``timeout`` with torch's error and a note, instead of 30 silent minutes.

In this process (importing torch and Lightning again in a subprocess would take longer than the wait):
``Trainer.fit`` with ``num_nodes=2`` and no launcher, so the process-group creation waits for real."""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import lightning as L
import pytest
import torch.distributed as dist
from helpers import BoringPipeline, boring_data
from lightning.fabric.utilities.rank_zero import rank_zero_only

import lightning_roundpipe.nodes as nodes
from lightning_roundpipe import RoundPipeStrategy

LAUNCHERS = ["LOCAL_RANK", "WORLD_SIZE", "RANK", "GROUP_RANK", "SLURM_NTASKS", "SLURM_JOB_NAME", "TORCHELASTIC_RUN_ID"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fit_alone(monkeypatch: pytest.MonkeyPatch, env: dict[str, str | None], timeout: float = 2.0):
    """One node of two started by hand (``env``: None unsets), the others never coming: the error it fails with."""
    monkeypatch.setattr(nodes, "NOTICE_EVERY", 0.4)
    monkeypatch.setattr(rank_zero_only, "rank", rank_zero_only.rank)  # the strategy sets it to the node's rank
    for key in [*LAUNCHERS, "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"]:
        monkeypatch.setenv(key, "")  # recorded, so what Lightning sets while connecting is undone after the test
        monkeypatch.delenv(key)
    for key, value in env.items():
        if value is not None:
            monkeypatch.setenv(key, value)
    trainer = L.Trainer(
        strategy=RoundPipeStrategy(timeout=timeout), accelerator="cpu", devices=1, num_nodes=2, max_steps=1,
        logger=False, enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
    )  # fmt: skip
    with pytest.raises(dist.DistError) as caught:  # torch's own error, kept
        trainer.fit(BoringPipeline(), boring_data(batch_size=8))
    assert not dist.is_initialized()
    return caught.value


@pytest.mark.timeout(20)
def test_node_0_alone_says_what_it_waits_for_repeats_it_and_fails_after_the_timeout(monkeypatch, capsys):
    port = free_port()
    start = time.monotonic()
    error = fit_alone(monkeypatch, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": "0"})
    elapsed = time.monotonic() - start
    assert elapsed < 12, elapsed  # the 2 s timeout, not torch's 30 minutes
    err = capsys.readouterr().err
    first = err[err.index("roundpipe: node 0 of 2") :]
    for part in (
        "is waiting for the other nodes (NODE_RANK 1) to join", f"127.0.0.1:{port}", "2 processes in all",
        f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port} NODE_RANK=1 ", "torchrun", "srun", "gives up after 2 s",
        "docs/multinode.md",
    ):  # fmt: skip
        assert part in first.split("still waiting")[0], (part, err)
    assert "is not set" not in err  # MASTER_ADDR, MASTER_PORT and NODE_RANK were all given
    assert err.count(f"node 0 of 2 still waiting for the other nodes (NODE_RANK 1) at 127.0.0.1:{port}") >= 2, err
    assert "joined" not in err
    note = "\n".join(getattr(error, "__notes__", []))
    assert "node 0 of 2 waited" in note and f"127.0.0.1:{port}" in note and "timeout=2" in note, (note, error)
    assert "docs/multinode.md" in note
    time.sleep(1.0)  # the reminders stopped with the wait
    assert "still waiting" not in capsys.readouterr().err


@pytest.mark.timeout(20)
def test_node_1_alone_without_address_or_port_says_which_variables_are_missing(monkeypatch, capsys):
    error = fit_alone(monkeypatch, {"NODE_RANK": "1"}, timeout=1.5)
    err = capsys.readouterr().err
    assert (
        "roundpipe: node 1 of 2 (NODE_RANK=1) is waiting for the other nodes (NODE_RANK 0) to join at 127.0.0.1:" in err
    )
    assert "MASTER_ADDR is not set" in err and "MASTER_PORT is not set" in err, err
    assert "NODE_RANK is not set" not in err
    assert "NODE_RANK=0 " in err  # how to start node 0
    assert "node 1 of 2 still waiting" in err
    assert any("node 1 of 2 waited" in n for n in getattr(error, "__notes__", [])), error


@pytest.mark.timeout(20)
def test_the_reminders_stop_once_the_nodes_joined(capsys):
    class Environment:  # a launcher's (not started by hand)
        main_address, main_port = "node0.example", 29500

    wait = nodes.Rendezvous(Environment(), 2, 4, timedelta(minutes=30))
    with wait.waiting(every=0.2):
        time.sleep(0.7)
    err = capsys.readouterr().err
    assert "node 2 of 4 (NODE_RANK=2) is waiting for the other nodes (NODE_RANK 0..1 and 3)" in err
    assert "node0.example:29500" in err and "started through a launcher (Environment)" in err
    assert "gives up after 1800 s" in err
    assert err.count("node 2 of 4 still waiting") >= 2
    assert err.rstrip().endswith("roundpipe: node 2: all 4 nodes joined after 1 s.")
    time.sleep(0.5)
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError) as caught, wait.waiting(every=5):
        raise ValueError("torch's")
    assert str(caught.value) == "torch's" and "node 2 of 4 waited 0 s" in caught.value.__notes__[0]
