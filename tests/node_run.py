"""One node of a multi-node test run (launched by tests/test_multinode.py, one process per node)."""

from __future__ import annotations

import os
import sys

import lightning as L
import torch
from helpers import BoringPipeline, boring_data

from lightning_roundpipe import RoundPipeStrategy


class DieAt(L.Callback):
    """This node's process ends abruptly (as if its machine went down) at a given step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            os._exit(3)


def main(out: str, num_nodes: int, async_optimizer: bool, batch_size: int, epochs: int, die_at: int = -1) -> None:
    L.seed_everything(1, verbose=False)
    module = BoringPipeline()
    strategy = RoundPipeStrategy(num_microbatches=3, async_optimizer=async_optimizer)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, num_nodes=num_nodes, max_epochs=epochs, logger=False,
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        callbacks=[DieAt(die_at)] if die_at >= 0 else [],
    )  # fmt: skip
    trainer.fit(module, boring_data(batch_size=batch_size))
    sampler = trainer.train_dataloader.sampler
    result = {
        "weights": torch.cat([p.detach().flatten() for p in module.parameters()]),
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "steps": trainer.global_step,
        "sampler": (type(sampler).__name__, getattr(sampler, "shuffle", None)),
    }
    torch.save(result, out)


if __name__ == "__main__":
    die_at = int(sys.argv[6]) if len(sys.argv) > 6 and os.environ.get("NODE_RANK") == sys.argv[7] else -1
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "async", int(sys.argv[4]), int(sys.argv[5]), die_at)
