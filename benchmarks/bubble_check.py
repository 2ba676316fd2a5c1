"""Measured bubble ratio (``RoundPipeMonitor``) next to the simulator's prediction, under a real Trainer.

A LightningModule holding the Qwen3-1.7B-shaped ``nn.Sequential`` (``benchmarks/qwen3_shape.py``)
trains with ``Trainer(strategy=RoundPipeStrategy(plan="auto"), precision="bf16-mixed")`` on the
GPUs given, with the monitor logging every step into a CSV logger. After the automatic plan is in
place, prints per step the measured bubble (``1 - mean busy fraction`` of the workers, where busy is
the CUDA-event time of the worker's kernels over the interval between batches), its two parts (idle
inside the step, between its first and last kernel, and the host gap between steps) and the
predicted bubble, and the mean differences in percentage points. ``--device cpu --model debug`` is a smoke test.

    python benchmarks/bubble_check.py --out benchmarks/results/bubble-check.json
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

from qwen3_shape import SHAPES, Shape, build, init

import lightning_roundpipe
from lightning_roundpipe import RoundPipeMonitor, RoundPipeStrategy
from lightning_roundpipe.runtime.profile import idle_gaps


class Tokens(Dataset):
    def __init__(self, shape: Shape, size: int, seq_len: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, shape.vocab, (size, seq_len + 1), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[i, :-1], self.tokens[i, 1:]


class Shaped(L.LightningModule):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        with torch.device("meta"):
            model = build(shape)
        self.model = init(model.to_empty(device="cpu"))
        self.starts: list[float] = []
        self.returned: list[float] = []
        self.ends: list[float] = []

    def on_train_batch_start(self, batch: object, batch_idx: int) -> None:
        self.starts.append(time.perf_counter())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, labels = batch
        loss = lightning_roundpipe.pipeline_loss(
            self.model, (tokens, labels), labels, lambda out, _: out, reduction=lambda t: (t != -100).sum()
        )
        self.returned.append(time.perf_counter())
        return loss

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        self.plan = str(self.trainer.strategy.engine.plan)
        engine = self.trainer.strategy.engine
        self.timeline = list(engine.stats.last_timeline)
        self.costs = None if engine.planner.layer_costs is None else asdict(engine.planner.layer_costs)
        self.ends.append(time.perf_counter())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-5, fused=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-1.7b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--seqs", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--planner", default="objective", choices=("objective", "fastest"))
    p.add_argument("--plan", default="auto", help='"auto" or an explicit plan such as "3,3|5,1,1"')
    p.add_argument("--steps", type=int, default=12)
    p.add_argument(
        "--double-buffer", default="none", choices=("none", "first", "all"), help="RoundPipeStrategy(double_buffer=...)"
    )
    p.add_argument("--settle", type=int, default=None, help="measured steps left out of the mean (default: half)")
    p.add_argument("--timeline", default=None, help="write the last measured step here (Chrome trace + PNG)")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    shape = SHAPES[args.model]
    L.seed_everything(0, verbose=False)
    module = Shaped(shape)
    data = DataLoader(Tokens(shape, args.seqs * args.steps, args.seq_len), batch_size=args.seqs)
    with tempfile.TemporaryDirectory() as tmp:
        logger = L.pytorch.loggers.CSVLogger(tmp, name="bubble")
        strategy = RoundPipeStrategy(
            num_microbatches=args.microbatches,
            plan=args.plan,
            profile_steps=args.profile_steps,
            planner=args.planner,
            double_buffer=args.double_buffer,
        )
        trainer = L.Trainer(
            strategy=strategy,
            accelerator="gpu" if args.device == "cuda" else "cpu", devices=args.devices, precision="bf16-mixed",
            max_steps=args.steps, log_every_n_steps=1, logger=logger, callbacks=[RoundPipeMonitor()],
            enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        )  # fmt: skip
        start = time.perf_counter()
        trainer.fit(module, data)
        wall = time.perf_counter() - start
        engine_plan = getattr(module, "plan", None)
        with open(Path(logger.log_dir) / "metrics.csv") as f:
            rows = list(csv.DictReader(f))
    steps = []
    for r in rows:
        if r.get("roundpipe/bubble_measured") and r.get("roundpipe/bubble_predicted"):
            steps.append(
                {
                    "step": int(r["step"]),
                    "measured": float(r["roundpipe/bubble_measured"]),
                    "predicted": float(r["roundpipe/bubble_predicted"]),
                    "stages": float(r["roundpipe/stages"]),
                    "in_step": float(r.get("roundpipe/bubble_in_step") or "nan"),
                    "host_gap": float(r.get("roundpipe/host_gap") or "nan"),
                    "handoff_s": float(r.get("roundpipe/handoff_s") or "nan"),
                    "drift": float(r.get("roundpipe/drift") or "nan"),
                    "busy": [float(v) for k, v in sorted(r.items()) if k.startswith("roundpipe/busy_worker") and v],
                }
            )
    print(f"plan {engine_plan}; {len(steps)} steps on the automatic plan; fit took {wall:.0f} s")
    head = f"{'step':>4} {'measured':>9} {'in step':>8} {'host gap':>8} {'predicted':>9} {'handoff s':>9}"
    print(head + "  idle per device")
    for s in steps:
        idle = " ".join(f"{1 - b:.3f}" for b in s["busy"])
        print(f"{s['step']:4d} {s['measured']:9.3f} {s['in_step']:8.3f} {s['host_gap']:8.3f}"
              f" {s['predicted']:9.3f} {s['handoff_s']:9.3f}  {idle}")  # fmt: skip
    gaps = idle_gaps(module.timeline) if module.timeline else {}
    for kind, g in gaps.items():
        print(f"last measured step, idle before a {kind} action: {g['seconds']:.3f} s in {g['count']:.0f}"
              f" (largest {1e3 * g['largest']:.1f} ms)")  # fmt: skip
    if args.timeline and module.timeline:
        from lightning_roundpipe.callbacks import write_timeline

        write_timeline(module.timeline, args.timeline)
    # where the main thread spends a step: inside training_step (the pipeline call returns when the
    # losses are known), from there to the end of the batch (optimizer step hook), and between batches
    k = min(4, len(module.ends) - 1)
    main_thread = {
        "training_step_s": sum(r - b for b, r in zip(module.starts[-k:], module.returned[-k:])) / k,
        "after_step_s": sum(e - r for r, e in zip(module.returned[-k:], module.ends[-k:])) / k,
        "between_batches_s": sum(b - e for e, b in zip(module.ends[-k - 1 : -1], module.starts[-k:])) / k,
    }
    print("main thread per step: " + ", ".join(f"{key} {v:.3f}" for key, v in main_thread.items()))
    # the second half of the steps, up to 10: on several GPUs step times alternate (2.4 and 2.9 s
    # measured on 2 H200s), so a window of three depends on where it starts
    last = module.ends[-1 - max(3, min(10, len(module.ends) // 2)) :]
    step_s = (last[-1] - last[0]) / (len(last) - 1)
    tokens_per_s = args.seqs * args.seq_len / step_s
    print(f"last {len(last) - 1} steps: {step_s:.3f} s/step, {tokens_per_s:.0f} tokens/s")
    gap = in_step_gap = worst = None
    tail = []
    if steps:
        # the step time is averaged over 4 steps, so the first 3 on a new plan still include profiling
        # steps; the first updates also allocate the optimizer state: judge the second half (at least 3 in)
        settle = max(3, len(steps) // 2) if args.settle is None else args.settle
        tail = steps[settle:] or steps
        gap = sum(s["measured"] - s["predicted"] for s in tail) / len(tail)
        in_step_gap = sum(s["in_step"] - s["predicted"] for s in tail) / len(tail)
        worst = max(abs(s["measured"] - s["predicted"]) for s in tail)
        print(f"mean measured - predicted over the last {len(tail)} steps: {100 * gap:+.1f} pp"
              f" (inside the step: {100 * in_step_gap:+.1f} pp; largest in one step {100 * worst:.1f} pp)")  # fmt: skip
    if args.out:
        device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
        command = "python benchmarks/bubble_check.py " + " ".join(sys.argv[1:])
        meta = {"date": time.strftime("%Y-%m-%d"), "command": command, "device": device, "torch": torch.__version__}
        result = {
            "plan": engine_plan,
            "steps": steps,
            "mean_gap_pp": None if gap is None else 100 * gap,
            "mean_in_step_gap_pp": None if gap is None else 100 * in_step_gap,
            "largest_step_gap_pp": None if gap is None else 100 * worst,
            "mean_over_steps": [s["step"] for s in tail] if steps else [],
            "fit_s": wall,
            "step_s": step_s,
            "tokens_per_s": tokens_per_s,
            # each step's own wall time (batch end to batch end): the busy fractions above are taken over
            # a 4-step window, so a one-off in one step shows in four of them; these show where it was
            "step_wall_s": [b - a for a, b in zip(module.ends, module.ends[1:])],
            "main_thread": main_thread,
            "idle_gaps": gaps,
            # what the prediction was made from, and the last measured step as it ran: enough to simulate
            # the plan again offline and compare action by action
            "layer_costs": module.costs,
            "last_timeline": module.timeline,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "results": result}, indent=1))


if __name__ == "__main__":
    main()
