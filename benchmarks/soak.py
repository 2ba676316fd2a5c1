"""GPU soak: a few hundred training steps under Lightning; GPU, pinned and resident memory and threads stay flat.

The Qwen3-1.7B-shaped ``nn.Sequential`` of ``benchmarks/qwen3_shape.py`` trains with
``Trainer(strategy=RoundPipeStrategy(), precision="bf16-mixed")`` (automatic plan, asynchronous
optimizer) on short sequences, so steps are quick and many. Every step records CUDA memory allocated
and reserved, the engine's pinned host bytes, resident memory and the thread count. Prints the growth
from step ``--settle`` to the end and whether each stays within its bound; writes JSON.
``--device cpu --model debug`` is a smoke test.

    python benchmarks/soak.py --out benchmarks/results/soak.json
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
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bubble_check import Shaped, Tokens
from qwen3_shape import SHAPES

from lightning_roundpipe import RoundPipeStrategy

MiB = 2**20
BOUNDS = {"cuda_allocated": 64 * MiB, "cuda_reserved": 256 * MiB, "pinned": 0, "rss": 512 * MiB, "threads": 0}


class Gauge(L.Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        engine = trainer.strategy.engine
        cuda = torch.cuda.is_available() and engine.devices[0].device.type == "cuda"
        self.rows.append(
            {
                "time": time.perf_counter(),
                "cuda_allocated": torch.cuda.memory_allocated() if cuda else 0,
                "cuda_reserved": torch.cuda.memory_reserved() if cuda else 0,
                "pinned": engine.pool.pinned_bytes,
                "rss": psutil.Process().memory_info().rss,
                "threads": threading.active_count(),
            }
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-1.7b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--settle", type=int, default=50, help="steps before the baseline (plan switch, allocator warm-up)")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    shape = SHAPES[args.model]
    L.seed_everything(0, verbose=False)
    module = Shaped(shape)
    data = DataLoader(Tokens(shape, args.seqs * args.steps, args.seq_len), batch_size=args.seqs)
    gauge = Gauge()
    trainer = L.Trainer(
        strategy=RoundPipeStrategy(num_microbatches=args.microbatches),
        accelerator="gpu" if args.device == "cuda" else "cpu", devices=args.devices, precision="bf16-mixed",
        max_steps=args.steps, logger=False, callbacks=[gauge], enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, data)
    rows = gauge.rows
    base, rest = rows[args.settle], rows[args.settle :]
    growth = {k: max(r[k] for r in rest) - base[k] for k in BOUNDS}
    flat = {k: growth[k] <= bound for k, bound in BOUNDS.items()}
    step_s = (rows[-1]["time"] - base["time"]) / (len(rows) - 1 - args.settle)
    print(f"{len(rows)} steps, {step_s:.3f} s/step after step {args.settle}")
    for k in BOUNDS:
        unit, scale = ("", 1) if k == "threads" else (" MiB", MiB)
        verdict = "flat" if flat[k] else "GREW"
        start, more = base[k] / scale, growth[k] / scale
        print(f"{k:15} at step {args.settle}: {start:10.1f}{unit}  then +{more:.1f}{unit}  {verdict}")
    if args.out:
        device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
        command = "python benchmarks/soak.py " + " ".join(sys.argv[1:])
        meta = {"date": time.strftime("%Y-%m-%d"), "command": command, "device": device, "torch": torch.__version__}
        result = {"growth": growth, "flat": flat, "bounds": BOUNDS, "step_s": step_s, "rows": rows}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "results": result}, indent=1))
    if not all(flat.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
