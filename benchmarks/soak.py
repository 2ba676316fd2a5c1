"""GPU soak: a few hundred training steps under Lightning; GPU, pinned and resident memory and threads stay flat.

The Qwen3-1.7B-shaped ``nn.Sequential`` of ``benchmarks/qwen3_shape.py`` trains with
``Trainer(strategy=RoundPipeStrategy(), precision="bf16-mixed")`` (automatic plan, asynchronous
optimizer) on short sequences, so steps are quick and many. Every step records CUDA memory allocated
and reserved, the engine's pinned host bytes, resident memory and the thread count. Prints, for each, the
growth of its ceiling from the first to the last quarter of the steps after ``--settle`` and whether it
stays within its bound; writes JSON. ``--device cpu --model debug`` is a smoke test; ``--reanalyse``
judges the rows of an earlier JSON again.

    python benchmarks/soak.py --out benchmarks/results/soak.json
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

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
        if len(self.rows) % 25 == 0:  # progress, so that a run cut by a time limit still says how far it got
            r = self.rows[-1]
            print(f"step {len(self.rows)}: allocated {r['cuda_allocated'] / MiB:.0f} MiB, rss {r['rss'] / MiB:.0f} MiB")


def growth_of(rows: list[dict[str, float]], settle: int) -> dict[str, float]:
    """How much each gauge grew: its highest value over the last quarter of the steps after ``settle``
    minus its highest over the first quarter. Values read at a batch's end differ by whatever buffers
    are in flight at that moment (one or two 64 MiB chunks); a leak raises the ceiling, noise does not."""
    quarter = max(1, (len(rows) - settle) // 4)
    first, last = rows[settle : settle + quarter], rows[-quarter:]
    return {k: max(r[k] for r in last) - max(r[k] for r in first) for k in BOUNDS}


def report(rows: list[dict[str, float]], settle: int) -> dict[str, Any]:
    growth = growth_of(rows, settle)
    flat = {k: growth[k] <= bound for k, bound in BOUNDS.items()}
    step_s = (rows[-1]["time"] - rows[settle]["time"]) / (len(rows) - 1 - settle)
    print(f"{len(rows)} steps, {step_s:.3f} s/step after step {settle}; growth = ceiling of the last quarter")
    print("minus ceiling of the first quarter after the settling steps")
    for k in BOUNDS:
        unit, scale = ("", 1) if k == "threads" else (" MiB", MiB)
        values = [r[k] / scale for r in rows[settle:]]
        verdict = "flat" if flat[k] else "GREW"
        print(
            f"{k:15} range {min(values):10.1f} - {max(values):10.1f}{unit}  growth {growth[k] / scale:+.1f}{unit}"
            f"  (bound {BOUNDS[k] / scale:.0f})  {verdict}"
        )
    return {"growth": growth, "flat": flat, "bounds": BOUNDS, "step_s": step_s, "settle": settle, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-1.7b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--settle", type=int, default=40, help="steps before the baseline (plan switch, allocator warm-up)")
    p.add_argument("--reanalyse", default=None, help="a JSON this script wrote: judge its recorded rows again")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    command = "python benchmarks/soak.py " + " ".join(sys.argv[1:])

    if args.reanalyse:
        recorded = json.loads(Path(args.reanalyse).read_text())
        result = report(recorded["results"]["rows"], args.settle)
        meta = {**recorded["meta"], "reanalysed_by": command}
    else:
        rows = run(args)
        result = report(rows, args.settle)
        device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
        meta = {"date": time.strftime("%Y-%m-%d"), "command": command, "device": device, "torch": torch.__version__}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "results": result}, indent=1))
    if not all(result["flat"].values()):
        sys.exit(1)


def run(args: argparse.Namespace) -> list[dict[str, float]]:
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
    return gauge.rows


if __name__ == "__main__":
    main()
