"""Step time with the optimizer: synchronous, asynchronous (layerwise protocol) and blocking-copy variants.

Same model and data as ``benchmarks/throughput.py`` (Qwen3-1.7B shape, bf16, 32 x 2048 tokens per
step, host AdamW(fused=True)); one configuration per process:

- ``fwd-bwd``: forward+backward alone, no optimizer (the floor);
- ``sync``: forward+backward, then the optimizer step on the host, then the next step;
- ``async``: the optimizer on a host thread with the layerwise consistency protocol (no barrier);
- ``barrier``: the optimizer on a host thread, but each step drains the pipeline and casts the
  previous update into the compute copies at once (paper section 4.3.2's blocking copy).

Prints seconds per step, async step time over forward+backward alone, and sync (and barrier) over
async. ``--device cpu --model debug`` runs the whole thing on CPU worker threads (a smoke test).

    python benchmarks/optimizer_overlap.py --out benchmarks/results/optimizer-overlap.json
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _driver import add_in_process_flag, run_or_drive, write
from qwen3_shape import SHAPES, build, init, num_parameters
from throughput import batch, default_plan

CONFIGS = ("fwd-bwd", "sync", "async", "barrier")


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    from lightning_roundpipe.engine import PipelineEngine
    from lightning_roundpipe.runtime import WorkerDevice
    from lightning_roundpipe.runtime.device import CudaWorkerDevice
    from lightning_roundpipe.runtime.updates import UpdateSpec
    from lightning_roundpipe.schedule import StagePlan

    shape = SHAPES[args.model]
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    with torch.device("meta"):
        model = build(shape)
    model = init(model.to_empty(device="cpu"))
    params = num_parameters(model)
    plan = StagePlan.parse(default_plan(len(model), args.fused_blocks))
    devices = [CudaWorkerDevice("cuda:0", 0) if cuda else WorkerDevice("cpu", i) for i in range(args.workers)]
    asynchronous = args.run in ("async", "barrier")
    engine = PipelineEngine(
        list(model.children()),
        devices,
        plan=plan,
        microbatches_per_round=max(args.workers, args.seqs // args.micro_batch),
        compute_dtype=torch.bfloat16,
        autocast_dtype=torch.bfloat16,
        asynchronous=asynchronous,
        consistency="barrier" if args.run == "barrier" else "layerwise",
    )
    opt = torch.optim.AdamW(engine.store.parameters, lr=1e-5, fused=True)
    del model
    gc.collect()

    def count(labels: torch.Tensor) -> torch.Tensor:
        return (labels != -100).sum()

    def step(i: int) -> None:
        tokens, labels = batch(shape, args.seqs, args.seq_len, i)
        engine.train_batch((tokens, labels), labels, lambda out, _: out, reduction=count)
        if args.run == "fwd-bwd":
            engine.store.clear_grads()
        elif args.run == "sync":
            engine.store.install_grads()
            opt.step()
            engine.store.clear_grads()
            engine.store.mark_dirty()
        else:
            engine.submit_step(UpdateSpec.capture(opt))

    try:
        for i in range(args.warmup):
            step(i)
        if asynchronous:
            engine.flush()
        start = time.perf_counter()
        marks = []
        for i in range(args.steps):
            step(args.warmup + i)
            marks.append(time.perf_counter())
        if asynchronous:
            engine.flush()  # the last update lands: its time is counted
        total = time.perf_counter() - start
    finally:
        engine.close()
    return {
        "step_s": total / args.steps,
        "returned_at_s": [m - start for m in marks],
        "parameters": params,
        "tokens_per_s": args.seqs * args.seq_len * args.steps / total,
        "model": args.model,
        "device": args.device,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", choices=CONFIGS, help="run one configuration in this process")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--model", default="qwen3-1.7b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--seqs", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--fused-blocks", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=None)
    add_in_process_flag(p)
    args = p.parse_args()
    command = sys.argv[1:]
    results = run_or_drive(__file__, args, run_one, lambda done: write(args.out, command, __file__, done))
    if results is None:  # this process measured one configuration
        return
    by = {r["config"]: r for r in results if "error" not in r}
    print(f"\n{'config':10} {'s/step':>8} {'tokens/s':>9}")
    for r in results:
        if "error" not in r:
            print(f"{r['config']:10} {r['step_s']:8.3f} {r['tokens_per_s']:9.0f}")
    if "async" in by and "fwd-bwd" in by:
        by["async"]["async_over_fwd_bwd"] = by["async"]["step_s"] / by["fwd-bwd"]["step_s"]
        print(f"async / fwd-bwd alone: {by['async']['async_over_fwd_bwd']:.3f}")
    for other in ("sync", "barrier"):
        if other in by and "async" in by:
            by[other][f"{other}_over_async"] = by[other]["step_s"] / by["async"]["step_s"]
            print(f"{other} / async: {by[other][f'{other}_over_async']:.3f}")
    write(args.out, command, __file__, results)


if __name__ == "__main__":
    main()
