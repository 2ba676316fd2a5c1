"""One node of a multi-node test run (launched by tests/test_multinode.py, one process per node)."""

from __future__ import annotations

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


def main(out: str, num_nodes: int, async_optimizer: bool, batch_size: int, epochs: int, die_at: int = -1) -> None:
    L.seed_everything(1, verbose=False)
    different = "WIDTH_RANK" in os.environ and os.environ["WIDTH_RANK"] == os.environ.get("NODE_RANK")
    module = Logged(width=int(os.environ["WIDTH"]) if different else 16)
    clip = float(os.environ.get("CLIP", "0")) or None
    callbacks: list[L.Callback] = [DieAt(die_at)] if die_at >= 0 else []
    if "HANG_RANK" in os.environ and os.environ["HANG_RANK"] == os.environ.get("NODE_RANK"):
        callbacks.append(HangAt(int(os.environ["HANG_AT"])))
    if os.environ.get("CKPT_DIR"):
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=os.environ["CKPT_DIR"], filename="{epoch}"))
    timeout = {"timeout": timedelta(seconds=float(os.environ["PG_TIMEOUT"]))} if os.environ.get("PG_TIMEOUT") else {}
    strategy = RoundPipeStrategy(num_microbatches=3, async_optimizer=async_optimizer, **timeout)
    trainer = L.Trainer(
        strategy=strategy, precision=os.environ.get("PRECISION", "32-true"), accelerator="cpu", devices=2,
        num_nodes=num_nodes, max_epochs=epochs, logger=False,
        enable_progress_bar=False, enable_checkpointing=bool(os.environ.get("CKPT_DIR")), enable_model_summary=False,
        callbacks=callbacks, gradient_clip_val=clip,
    )  # fmt: skip
    trainer.fit(module, boring_data(batch_size=batch_size), ckpt_path=os.environ.get("RESUME") or None)
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


if __name__ == "__main__":
    die_at = int(sys.argv[6]) if len(sys.argv) > 6 and os.environ.get("NODE_RANK") == sys.argv[7] else -1
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "async", int(sys.argv[4]), int(sys.argv[5]), die_at)
