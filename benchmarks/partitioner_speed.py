"""How long the partitioner takes for 32, 64, 94 and 128 layers (decoder-like costs, 8 workers, 16 micro-batches).

Costs: blocks with +-20% noise and backward 2.5-3.5x forward, without a head ("noisy") and with a
head 6x a block ("noisy+head"); with a memory limit that forces many stages; uniform blocks with a head.
Prints the median of 7 runs per case.

    python benchmarks/partitioner_speed.py --out benchmarks/results/partitioner-speed.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_roundpipe.schedule.partition import LayerCosts, partition


def costs(layers: int, case: str, rng: random.Random) -> tuple[LayerCosts, float | None]:
    forward = [1.0 if case == "uniform" else rng.uniform(0.8, 1.2) for _ in range(layers)]
    if case != "noisy":
        forward[-1] = 6.0  # an LM head
    backward = [f * (3.0 if case == "uniform" else rng.uniform(2.5, 3.5)) for f in forward]
    params = [100 * 2**20] * layers
    acts = [600 * 2**20] * layers
    limit = 3.2e9 if case == "memory-limited" else None
    return LayerCosts(tuple(forward), tuple(backward), tuple(params), tuple(params), (0,) * layers, tuple(acts)), limit


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rng = random.Random(0)
    rows = []
    for layers in (32, 64, 94, 128):
        for case in ("noisy", "noisy+head", "memory-limited", "uniform"):
            c, limit = costs(layers, case, rng)
            times = []
            for _ in range(7):
                start = time.perf_counter()
                result = partition(c, workers=8, microbatches=16, memory_limit=limit)
                times.append(time.perf_counter() - start)
            rows.append(
                {"layers": layers, "case": case, "ms": 1e3 * statistics.median(times), "slots": result.plan.num_slots}
            )
            print(f"L={layers:4d} {case:15s} {rows[-1]['ms']:7.2f} ms  ({result.plan.num_slots} slots)")
    if args.out:
        command = "python benchmarks/partitioner_speed.py " + " ".join(sys.argv[1:])
        meta = {"date": time.strftime("%Y-%m-%d"), "command": command, "machine": "CI machine kind, 2 cores"}
        Path(args.out).write_text(json.dumps({"meta": meta, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
