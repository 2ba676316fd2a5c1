"""Host-to-GPU bandwidth, alone and with every GPU streaming at once, and the host's own memory bandwidth.

What limits several GPUs streaming weights, gradients and activations through one host: each GPU's
PCIe link, a shared switch or root complex (concurrent numbers below the sum of the single ones), or
host memory (the copy bandwidth of pinned buffers). Pinned buffers of ``--gib`` GiB per GPU; each
figure is the best of ``--repeats`` timed repetitions.

    python benchmarks/pcie.py --out benchmarks/results/pcie.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _driver import write

GB = 1e9


def timed(fn: Any, repeats: int) -> float:
    """Best wall time of ``fn()`` (which must synchronize what it issues)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def copies(gpus: list[int], size: int, directions: str, repeats: int) -> dict[str, float]:
    """GB/s per direction of ``size``-byte copies on every GPU in ``gpus`` at once, each on its own streams."""
    buffers = {}
    for g in gpus:
        host_up = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        host_down = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        dev_up = torch.empty(size, dtype=torch.uint8, device=f"cuda:{g}")
        dev_down = torch.empty(size, dtype=torch.uint8, device=f"cuda:{g}")
        streams = torch.cuda.Stream(g), torch.cuda.Stream(g)
        buffers[g] = (host_up, host_down, dev_up, dev_down, streams)

    def run() -> None:
        for host_up, host_down, dev_up, dev_down, (up, down) in buffers.values():
            if "up" in directions:
                with torch.cuda.stream(up):
                    dev_up.copy_(host_up, non_blocking=True)
            if "down" in directions:
                with torch.cuda.stream(down):
                    host_down.copy_(dev_down, non_blocking=True)
        for *_, (up, down) in buffers.values():
            up.synchronize()
            down.synchronize()

    seconds = timed(run, repeats)
    per_direction = size * len(gpus) / seconds / GB
    return {
        "gpus": gpus,
        "directions": directions,
        "total_gb_s": per_direction * (2 if directions == "up+down" else 1),
        "per_gpu_per_direction_gb_s": per_direction / len(gpus),
    }


def host_memory(size: int, repeats: int) -> dict[str, float]:
    """Pinned-to-pinned copy on the CPU with torch's threads: read plus write bandwidth of host memory."""
    src = torch.ones(size, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    seconds = timed(lambda: dst.copy_(src), repeats)
    threads = torch.get_num_threads()
    return {"copy_gb_s": size / seconds / GB, "read_plus_write_gb_s": 2 * size / seconds / GB, "threads": threads}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="bytes per copy, in GiB")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    size = int(args.gib * 2**30)
    n = torch.cuda.device_count()
    rows = []
    for directions in ("up", "down", "up+down"):
        for g in range(n):
            rows.append(copies([g], size, directions, args.repeats))
        if n > 1:
            rows.append(copies(list(range(n)), size, directions, args.repeats))
    print(f"{'GPUs':12} {'direction':9} {'total GB/s':>10} {'per GPU and direction':>22}")
    for r in rows:
        print(f"{','.join(map(str, r['gpus'])):12} {r['directions']:9} {r['total_gb_s']:10.1f}"
              f" {r['per_gpu_per_direction_gb_s']:22.1f}")  # fmt: skip
    host = host_memory(size * 4, args.repeats)
    print(f"host memory: {host['copy_gb_s']:.1f} GB/s copied ({host['read_plus_write_gb_s']:.1f} read+write),"
          f" {host['threads']} threads")  # fmt: skip
    out = [*rows, {"host_memory": host}]
    print("RESULT " + json.dumps(out))
    write(args.out, sys.argv[1:], __file__, out)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
