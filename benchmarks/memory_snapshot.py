"""Where a CUDA out-of-memory came from: record the caching allocator's history, dump it at the failure,
and summarise the dump per device and per stream.

roundpipe's workers allocate on several streams of each device (compute, activations up, parameters
up); the allocator keeps a pool per stream and splits segments, so "reserved but unallocated" memory
can be free in one stream's pool and useless to another, or stranded inside segments that still hold a
live block. The summary shows, per device and stream: segments, reserved, allocated, free inside
partly used segments, and the largest free block.

    python benchmarks/baselines.py --run roundpipe --workers 2 --seqs 2 --micro-batch 1 --seq-len 32768 \\
        --warmup 3 --steps 1 --gpu-gib 8 --memory-snapshot $OUT/oom.pickle
    python benchmarks/memory_snapshot.py $OUT/oom.pickle
"""

from __future__ import annotations

import argparse
import pickle
from collections import defaultdict
from pathlib import Path
from typing import Any

GiB = 1024**3


def record_until_out_of_memory(path: str | Path, max_entries: int = 100_000) -> None:
    """Record allocation history from now on; at the first out-of-memory, inside the allocator (before
    anything is freed), write the snapshot to ``path`` and its summary next to it (``.txt``)."""
    import torch

    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    written = []

    def observer(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
        if not written:
            written.append(path)
            dump(path, f"out of memory on device {device} allocating {alloc / 2**20:.0f} MiB")

    torch._C._cuda_attach_out_of_memory_observer(observer)


def dump(path: str | Path, headline: str = "") -> None:
    """Write the allocator's snapshot (segments, blocks, recent history) to ``path``, and the summary."""
    import torch

    snapshot = torch.cuda.memory._snapshot()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(snapshot, f)
    Path(path).with_suffix(".txt").write_text(headline + "\n" + table(summarise(snapshot)) + "\n")


def summarise(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (device, stream): what the allocator holds there."""
    rows: dict[tuple[int, int], dict[str, Any]] = defaultdict(
        lambda: {"segments": 0, "reserved": 0, "allocated": 0, "stranded": 0, "largest_free": 0, "sizes": []}
    )
    for segment in snapshot.get("segments", []):
        row = rows[(segment.get("device", 0), segment.get("stream", 0))]
        row["segments"] += 1
        row["reserved"] += segment["total_size"]
        row["sizes"].append(segment["total_size"])
        live = sum(b["size"] for b in segment["blocks"] if b["state"].startswith("active"))
        row["allocated"] += live
        if live:  # free space the allocator cannot give back while a block of the segment lives
            row["stranded"] += segment["total_size"] - live
        for block in segment["blocks"]:
            if block["state"] == "inactive":
                row["largest_free"] = max(row["largest_free"], block["size"])
    out = []
    for (device, stream), row in sorted(rows.items()):
        sizes = sorted(row.pop("sizes"), reverse=True)
        out.append({"device": device, "stream": stream, **row, "largest_segments": sizes[:5]})
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'device':>6} {'stream':>16} {'segments':>8} {'reserved':>9} {'allocated':>9} {'stranded':>9}"
             f" {'largest free':>12}  largest segments (MiB)"]  # fmt: skip
    for r in rows:
        lines.append(f"{r['device']:6d} {r['stream']:16d} {r['segments']:8d} {r['reserved'] / GiB:9.2f}"
                     f" {r['allocated'] / GiB:9.2f} {r['stranded'] / GiB:9.2f} {r['largest_free'] / GiB:12.2f}"
                     f"  {[s // 2**20 for s in r['largest_segments']]}")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("snapshot", help="a pickle written by dump()")
    args = p.parse_args()
    with open(args.snapshot, "rb") as f:
        print(table(summarise(pickle.load(f))))


if __name__ == "__main__":
    main()
