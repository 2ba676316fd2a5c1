"""Per-step exchange of multi-node roundpipe against its model, measured with processes on this machine.

Each of ``--nodes`` processes builds the same MLP's host store (``--layers`` x ``--width`` squared
fp32 parameters), fills its gradients, and times what a step exchanges: every group's gradient
reduced to its owner and every group's weights broadcast back (``NodeExchange``), next to a plain
all-reduce of the same bytes. The model says both move ``2 (K-1)/K x 4 P`` bytes per node, so the
exchange should take about the all-reduce's time; the step it can hide behind is the GPU time.

    python benchmarks/multinode_exchange.py --nodes 2 --out benchmarks/results/multinode-exchange.json
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
from torch import nn


def node(rank: int, args: argparse.Namespace, port: int, queue: mp.Queue) -> None:
    from lightning_roundpipe.runtime.exchange import NodeExchange
    from lightning_roundpipe.runtime.host_store import HostStore

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=args.nodes)
    torch.manual_seed(0)
    layers = [nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers)]
    store = HostStore(layers)
    for g in store.groups:
        if g.grad is not None:
            g.grad.normal_()
    exchange = NodeExchange(store, dist.new_group(backend="gloo"), rank, args.nodes)
    flat = torch.cat([g.grad for g in store.groups if g.grad is not None])
    exchange.reduce_all()  # warm-up: connections
    dist.all_reduce(flat)
    times: dict[str, list[float]] = {"reduce_to_owners": [], "broadcast_weights": [], "all_reduce": []}
    for _ in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        exchange.reduce_all()
        t1 = time.perf_counter()
        exchange.broadcast_all()
        t2 = time.perf_counter()
        dist.barrier()
        t3 = time.perf_counter()
        dist.all_reduce(flat)
        t4 = time.perf_counter()
        times["reduce_to_owners"].append(t1 - t0)
        times["broadcast_weights"].append(t2 - t1)
        times["all_reduce"].append(t4 - t3)
    dist.destroy_process_group()
    if rank == 0:
        queue.put({k: sorted(v)[len(v) // 2] for k, v in times.items()} | {"parameters": flat.numel()})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue: mp.Queue = mp.get_context("spawn").Queue()
    mp.start_processes(node, args=(args, port, queue), nprocs=args.nodes, start_method="spawn")
    r = queue.get()
    exchange = r["reduce_to_owners"] + r["broadcast_weights"]
    moved = 2 * (args.nodes - 1) / args.nodes * 4 * r["parameters"]
    r |= {"exchange_s": exchange, "bytes_per_node": moved, "exchange_over_all_reduce": exchange / r["all_reduce"],
          "exchange_gb_s": moved / exchange / 1e9, "all_reduce_gb_s": moved / r["all_reduce"] / 1e9}  # fmt: skip
    print(f"{args.nodes} processes, {r['parameters'] / 1e6:.1f} M fp32 parameters, {moved / 1e9:.2f} GB per node:"
          f" reduce to owners {r['reduce_to_owners'] * 1e3:.0f} ms + broadcast {r['broadcast_weights'] * 1e3:.0f} ms"
          f" = {exchange * 1e3:.0f} ms ({r['exchange_gb_s']:.2f} GB/s); all-reduce {r['all_reduce'] * 1e3:.0f} ms"
          f" ({r['all_reduce_gb_s']:.2f} GB/s); ratio {r['exchange_over_all_reduce']:.2f}")  # fmt: skip
    if args.out:
        command = "python benchmarks/multinode_exchange.py " + " ".join(sys.argv[1:])
        meta = {"date": time.strftime("%Y-%m-%d"), "command": command, "device": "cpu (loopback)",
                "torch": torch.__version__, "cpus": os.cpu_count()}  # fmt: skip
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "results": r}, indent=1))


if __name__ == "__main__":
    main()
