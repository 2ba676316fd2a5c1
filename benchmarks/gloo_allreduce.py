"""Host all-reduce bandwidth with gloo between processes: the exchange multi-node roundpipe does per step.

Starts ``--nodes`` processes on this machine (loopback TCP), all-reduces fp32 tensors of ``--mib`` MiB
(the size of a large flat gradient group) ``--repeats`` times, and prints the algorithm bandwidth
(tensor bytes / time) and the bus bandwidth (x 2(K-1)/K, what each process sends and receives).
Loopback only for now: between machines the network, not memory copies, sets the number.

    python benchmarks/gloo_allreduce.py --nodes 2 --out benchmarks/results/gloo-allreduce.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank: int, nodes: int, mib: int, repeats: int, port: int, queue: mp.Queue) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=rank, world_size=nodes)
    x = torch.ones(mib * 2**20 // 4)
    dist.all_reduce(x)  # warm-up (connections)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(x)
    elapsed = time.perf_counter() - start
    dist.destroy_process_group()
    if rank == 0:
        queue.put(elapsed / repeats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue: mp.Queue = mp.get_context("spawn").Queue()
    mp.start_processes(worker, args=(args.nodes, args.mib, args.repeats, port, queue), nprocs=args.nodes,
                       start_method="spawn")  # fmt: skip
    seconds = queue.get()
    nbytes = args.mib * 2**20
    algbw = nbytes / seconds / 1e9
    busbw = algbw * 2 * (args.nodes - 1) / args.nodes
    print(f"{args.nodes} processes, {args.mib} MiB fp32 all-reduce: {seconds * 1e3:.1f} ms,"
          f" algorithm bandwidth {algbw:.2f} GB/s, bus bandwidth {busbw:.2f} GB/s")  # fmt: skip
    if args.out:
        command = "python benchmarks/gloo_allreduce.py " + " ".join(sys.argv[1:])
        meta = {"date": time.strftime("%Y-%m-%d"), "command": command, "device": "cpu (loopback)",
                "torch": torch.__version__, "cpus": os.cpu_count()}  # fmt: skip
        result = {"seconds": seconds, "algbw_gb_s": algbw, "busbw_gb_s": busbw, "mib": args.mib, "nodes": args.nodes}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "results": result}, indent=1))


if __name__ == "__main__":
    main()
