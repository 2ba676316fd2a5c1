"""One node of a multi-node test run (launched by tests/test_multinode.py, one process per node)."""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import lightning as L
import torch
from helpers import BoringPipeline, boring_data

from lightning_roundpipe import RoundPipeStrategy


class Logged(BoringPipeline):
    def on_train_epoch_end(self) -> None:
        self.log("node_rank_mean", float(self.trainer.global_rank), sync_dist=True)


class DieAt(L.Callback):
    """This node's process ends abruptly (as if its machine went down) at a given step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            os._exit(3)


class HangAt(L.Callback):
    """This node's process stops making progress (alive, stuck) at a given step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            print(f"node {trainer.global_rank} hangs at step {self.step}", flush=True)
            time.sleep(120)


def wait_for_the_other_nodes(folder: str, num_nodes: int) -> None:
    """Start together (``START_TOGETHER``): every node waits here, after its imports, until all are there, so
    a short process-group timeout bounds the exchanges of training and not how much later one process got
    here on a busy machine."""
    os.makedirs(folder, exist_ok=True)
    open(os.path.join(folder, os.environ.get("NODE_RANK", "0")), "w").close()
    deadline = time.monotonic() + 200
    while len(os.listdir(folder)) < num_nodes and time.monotonic() < deadline:
        time.sleep(0.02)


def main(
    out: str, num_nodes: int, async_optimizer: bool, batch_size: int, epochs: int, die_at: int = -1,
    clip: float | None = None, precision: str | None = None, ckpt_dir: str | None = None, resume: str | None = None,
) -> None:  # fmt: skip
    """One fit; ``clip``, ``precision``, ``ckpt_dir`` and ``resume`` default to the variables CLIP, PRECISION,
    CKPT_DIR and RESUME."""
    clip = clip if clip is not None else float(os.environ.get("CLIP", "0"))
    precision = precision or os.environ.get("PRECISION", "32-true")
    ckpt_dir = ckpt_dir if ckpt_dir is not None else os.environ.get("CKPT_DIR")
    resume = resume if resume is not None else os.environ.get("RESUME")
    L.seed_everything(1, verbose=False)
    different = "WIDTH_RANK" in os.environ and os.environ["WIDTH_RANK"] == os.environ.get("NODE_RANK")
    module = Logged(width=int(os.environ["WIDTH"]) if different else 16)
    callbacks: list[L.Callback] = [DieAt(die_at)] if die_at >= 0 else []
    if "HANG_RANK" in os.environ and os.environ["HANG_RANK"] == os.environ.get("NODE_RANK"):
        callbacks.append(HangAt(int(os.environ["HANG_AT"])))
    if ckpt_dir:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}"))
    timeout = {"timeout": timedelta(seconds=float(os.environ["PG_TIMEOUT"]))} if os.environ.get("PG_TIMEOUT") else {}
    strategy = RoundPipeStrategy(num_microbatches=3, async_optimizer=async_optimizer, **timeout)
    if os.environ.get("START_TOGETHER"):
        wait_for_the_other_nodes(os.environ["START_TOGETHER"], num_nodes)
    trainer = L.Trainer(
        strategy=strategy, precision=precision, accelerator="cpu", devices=2,
        num_nodes=num_nodes, max_epochs=epochs, logger=False,
        enable_progress_bar=False, enable_checkpointing=bool(ckpt_dir), enable_model_summary=False,
        callbacks=callbacks, gradient_clip_val=clip or None,
    )  # fmt: skip
    trainer.fit(module, boring_data(batch_size=batch_size), ckpt_path=resume or None)
    sampler = trainer.train_dataloader.sampler
    result = {
        "weights": torch.cat([p.detach().flatten() for p in module.parameters()]),
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "steps": trainer.global_step,
        "sampler": (type(sampler).__name__, getattr(sampler, "shuffle", None)),
        "logged": float(trainer.callback_metrics["node_rank_mean"]),
        "optimizer_state": sorted(n for n, p in module.named_parameters() if p in trainer.optimizers[0].state),
    }
    torch.save(result, out)


def main_of_runs(path: str, num_nodes: int, batch_size: int) -> None:
    """Several fits one after another in this process (the JSON file's list: each run's ``out``, where
    ``{rank}`` stands for the node's rank, ``mode`` and ``epochs``, optionally ``clip``, ``precision``,
    ``ckpt_dir`` and ``resume``), each with a new module, strategy and Trainer, seeded as in a process of
    its own: a process's start (its imports, the process group forming) paid once for all of them."""
    with open(path) as f:
        runs = json.load(f)
    for run in runs:
        out = run["out"].format(rank=os.environ.get("NODE_RANK", "0"))
        print(f"=== run {out}", flush=True)
        main(out, num_nodes, run["mode"] == "async", batch_size, run["epochs"], clip=run.get("clip", 0.0),
             precision=run.get("precision", "32-true"), ckpt_dir=run.get("ckpt_dir", ""),
             resume=run.get("resume", ""))  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1] == "--runs":
        main_of_runs(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        die_at = int(sys.argv[6]) if len(sys.argv) > 6 and os.environ.get("NODE_RANK") == sys.argv[7] else -1
        main(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "async", int(sys.argv[4]), int(sys.argv[5]), die_at)
