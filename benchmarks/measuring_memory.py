"""Host memory while ``plan="auto"`` measures the layers, against the plan's steady state (issue 25).

One layer per stage keeps every layer's input on the host until its backward. A model whose boundaries
dominate (``--layers`` blocks of ``Linear(width, width)`` and ``tanh``, ``--batch`` rows per batch) runs
four steps through ``Trainer(strategy=RoundPipeStrategy(async_optimizer=...))``; every step's end records
the resident memory and its peak since the previous step (sampled every 5 ms). On CPU workers the
boundaries are ordinary host tensors, so the effect shows without a GPU.

    python benchmarks/measuring_memory.py --device cpu --out $OUT/measuring-memory.json
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import lightning as L
import psutil
import torch
from torch import nn

from lightning_roundpipe import RoundPipeStrategy, pipeline_loss

GiB = 2**30


class Blocks(L.LightningModule):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)])

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return pipeline_loss(self.net, x, y, nn.functional.mse_loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Steps(L.Callback):
    def __init__(self) -> None:
        self.process, self.peak, self.rows = psutil.Process(), 0, []
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.005)

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: object) -> None:
        now = self.process.memory_info().rss
        row = {"step": trainer.global_step, "rss_gib": now / GiB, "peak_gib": max(self.peak, now) / GiB,
               "plan": str(trainer.strategy.engine.plan)}  # fmt: skip
        self.rows.append(row)
        self.peak = 0
        print(row, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch", type=int, default=262144, help="rows per batch (one optimizer step)")
    p.add_argument("--asynchronous", action="store_true", help="the asynchronous optimizer (default: synchronous)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    x, y = torch.randn(args.batch * 4, args.width), torch.randn(args.batch * 4, args.width)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=args.batch)
    steps = Steps()
    trainer = L.Trainer(
        strategy=RoundPipeStrategy(async_optimizer=args.asynchronous), accelerator=args.device, devices=1,
        max_steps=4, logger=False, callbacks=[steps], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Blocks(args.layers, args.width), data)
    result = {"boundary_mib_per_batch": args.batch * args.width * 4 / 2**20, "steps": steps.rows}
    if args.out:
        command = "python benchmarks/measuring_memory.py " + " ".join(sys.argv[1:])
        meta = {"date": time.strftime("%Y-%m-%d"), "command": command}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "result": result}, indent=2))


if __name__ == "__main__":
    main()
