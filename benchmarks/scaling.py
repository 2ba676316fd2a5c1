"""Strong scaling of roundpipe over 1, 2, 4, 8 GPUs at a fixed global batch, through Lightning.

For each model shape and GPU count, one fresh process runs ``baselines.py --run roundpipe --workers N``:
the full training step (automatic plan, asynchronous host AdamW, bf16), ``--seqs`` sequences of
``--seq-len`` tokens per optimizer step whatever ``N``. Micro-batches of ``--micro-batch`` sequences,
fewer sequences where a round would otherwise have fewer micro-batches than workers. Prints tokens/s,
speed-up and efficiency (speed-up / N) against one GPU, peak GPU memory of the busiest device and the
achieved host-to-device and device-to-host bandwidth of all GPUs together. Throughput is steady state
(``baselines.py``'s ``Clock``: the end-of-training drain is reported apart, ``drain_s``).

    python benchmarks/scaling.py --models qwen3-1.7b,qwen3-4b --gpus 1,2 --out benchmarks/results/scaling.json

The longest sequence at 1 and N GPUs comes from ``baselines.py --max-seq roundpipe --workers N``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _driver import run_configs, write

BASELINES = str(Path(__file__).resolve().parent / "baselines.py")


def efficiency_table(results: list[dict[str, Any]]) -> None:
    """Add ``speedup`` and ``efficiency`` against the same model's one-GPU run, and print them."""
    one = {r["model"]: r["tokens_per_s"] for r in results if r.get("workers") == 1 and "error" not in r}
    print(f"\n{'model':12} {'GPUs':>4} {'tokens/s':>9} {'speed-up':>8} {'eff.':>5} {'GPU GiB':>8}"
          f" {'H2D GB/s':>8} {'D2H GB/s':>8}  plan")  # fmt: skip
    for r in results:
        if "error" in r:
            print(f"{r['model']:12} {r['workers']:4d} failed")
            continue
        base = one.get(r["model"])
        r["speedup"] = r["tokens_per_s"] / base if base else None
        r["efficiency"] = r["speedup"] / r["workers"] if base else None
        speedup = f"{r['speedup']:8.2f} {r['efficiency']:5.2f}" if base else f"{'-':>8} {'-':>5}"
        print(f"{r['model']:12} {r['workers']:4d} {r['tokens_per_s']:9.0f} {speedup} {r['peak_gpu_gib']:8.2f}"
              f" {r.get('h2d_gb_s', 0):8.1f} {r.get('d2h_gb_s', 0):8.1f}  {r.get('plan', '')}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen3-1.7b,qwen3-4b")
    p.add_argument("--gpus", default=None, help="GPU counts, e.g. 1,2,4,8 (default: powers of two up to all)")
    p.add_argument("--seqs", type=int, default=32, help="sequences per optimizer step (fixed over GPU counts)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps: profiling (2) and the first planned one")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument(
        "--double-buffer", default="none", choices=("none", "first", "all"), help="RoundPipeStrategy(double_buffer=...)"
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.gpus is None:
        import torch

        n = torch.cuda.device_count() if args.device == "cuda" else 2
        counts = [c for c in (1, 2, 4, 8) if c <= n]
    else:
        counts = [int(c) for c in args.gpus.split(",")]

    results: list[dict[str, Any]] = []
    for model in args.models.split(","):
        for n in counts:
            micro_batch = min(args.micro_batch, max(1, args.seqs // n))
            shared = dict(model=model, workers=n, seqs=args.seqs, seq_len=args.seq_len, micro_batch=micro_batch,
                          steps=args.steps, warmup=args.warmup, device=args.device,
                          double_buffer=args.double_buffer)  # fmt: skip
            [result] = run_configs(BASELINES, ["roundpipe"], shared)
            result.update(model=model, workers=n, micro_batch=micro_batch, double_buffer=args.double_buffer)
            results.append(result)
            write(args.out, sys.argv[1:], __file__, results)  # a killed command keeps what finished
    efficiency_table(results)
    write(args.out, sys.argv[1:], __file__, results)


if __name__ == "__main__":
    main()
