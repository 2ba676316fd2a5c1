"""Bubble ratios of pipeline schedules from measured per-layer times (paper Figure 19 analogue).

Measures each layer's forward and recompute+backward time on one GPU through the engine's own
profiling (one layer per stage, micro-batches of 4 x 2048 tokens, bf16), for the Qwen3-1.7B shape and
an 8-layer slice of a Llama-3.1-8B shape, then simulates 8 GPUs x 16 micro-batches for GPipe, 1F1B,
interleaved 1F1B, looped BFS (2 chunks per GPU) and RoundPipe synchronous/asynchronous with the
partitioner's plan. Prints a table (total, imbalance, structural bubble), writes JSON and a bar chart.
``--device cpu --model debug`` is a smoke test; ``--costs`` simulates the costs of an earlier run again
(after a change to the partitioner or the simulator; no GPU needed).

    python benchmarks/schedules.py --out benchmarks/results/schedules
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from qwen3_shape import SHAPES, Shape, build, init
from throughput import batch

SLICES = {
    "qwen3-1.7b": ("qwen3-1.7b", None),
    # 8 of Llama-3.1-8B's 32 blocks are measured; the simulation repeats them to the full 32 (+ embedding, head)
    "llama-8b-slice": (Shape(hidden=4096, layers=8, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=128256), 34),
    "debug": ("debug", None),
}


def measure(name: str, args: argparse.Namespace) -> Any:
    from lightning_roundpipe.engine import PipelineEngine
    from lightning_roundpipe.runtime import WorkerDevice
    from lightning_roundpipe.runtime.device import CudaWorkerDevice

    shape_or_name, _ = SLICES[name]
    shape = SHAPES[shape_or_name] if isinstance(shape_or_name, str) else shape_or_name
    with torch.device("meta"):
        model = build(shape)
    model = init(model.to_empty(device="cpu"))
    device = CudaWorkerDevice("cuda:0", 0) if args.device == "cuda" else WorkerDevice("cpu", 0)
    engine = PipelineEngine(
        list(model.children()), [device], plan="auto", profile_steps=args.profile_steps,
        microbatches_per_round=args.microbatches_measured, compute_dtype=torch.bfloat16, autocast_dtype=torch.bfloat16,
    )  # fmt: skip
    try:
        for i in range(args.profile_steps + 1):  # the first batch also warms up
            tokens, labels = batch(shape, args.micro_batch * args.microbatches_measured, args.seq_len, i)
            engine.train_batch((tokens, labels), labels, lambda out, _: out, reduction=lambda t: (t != -100).sum())
            engine.store.clear_grads()
            if i == 0:
                engine.planner.replan()  # measure after the warm-up batch
        return engine.planner.layer_costs
    finally:
        engine.close()


def widen(costs: Any, layers: int) -> Any:
    """The measured blocks repeated to ``layers`` layers (embedding and head kept): partitioner timing."""
    from lightning_roundpipe.schedule.partition import LayerCosts

    def stretch(values: tuple[float, ...]) -> tuple[float, ...]:
        blocks = values[1:-1] or values[:1]
        middle = [blocks[i % len(blocks)] for i in range(layers - 2)]
        return (values[0], *middle, values[-1])

    return LayerCosts(stretch(costs.forward), stretch(costs.backward))


def main() -> None:
    from lightning_roundpipe.schedule.choose import fastest_plan
    from lightning_roundpipe.schedule.partition import partition
    from lightning_roundpipe.schedule.simulate import SCHEDULES, bubbles, roundpipe

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen3-1.7b,llama-8b-slice")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--microbatches-measured", type=int, default=2)
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=16)
    p.add_argument("--costs", default=None, help="a JSON this script wrote: simulate its measured costs again")
    p.add_argument("--out", default=None, help="path prefix for .json and .png")
    args = p.parse_args()
    recorded = json.loads(Path(args.costs).read_text())["results"] if args.costs else None
    if args.device == "cuda" and recorded is None:
        torch.cuda.set_device(0)

    results: dict[str, Any] = {}
    for name in args.models.split(","):
        if recorded is not None:  # the same measurements through today's partitioner and simulator
            from lightning_roundpipe.schedule.partition import LayerCosts

            measured = LayerCosts(**{k: tuple(v) for k, v in recorded[name]["costs"].items()})
        else:
            measured = measure(name, args)
        assert measured is not None
        simulated_layers = SLICES[name][1]
        costs = widen(measured, simulated_layers) if simulated_layers else measured
        start = time.perf_counter()
        plan = partition(costs, args.workers, args.microbatches).plan
        results[name] = {"costs": asdict(measured), "simulated_layers": costs.num_layers, "plan": str(plan),
                         "partition_ms": 1e3 * (time.perf_counter() - start)}  # fmt: skip
        print(f"\n{name}: plan {plan} ({plan.num_slots} slots)")
        print(f"{'schedule':18} {'bubble':>7} {'imbalance':>9} {'structural':>10}")
        for schedule in SCHEDULES:
            try:
                b = bubbles(schedule, costs, args.workers, args.microbatches, plan=plan)
            except ValueError as err:  # e.g. more stages than layers for interleaved schedules
                results[name][schedule] = {"error": str(err)}
                print(f"{schedule:18} n/a: {err}")
                continue
            results[name][schedule] = asdict(b)
            print(f"{schedule:18} {b.total:7.3f} {b.imbalance:9.3f} {b.structural:10.3f}")
        # the plan the simulator finds fastest among the objective's near-optimal ones (schedule.choose):
        # its period, not only its bubble, since a larger fused stage also does less work
        start = time.perf_counter()
        fastest = fastest_plan(costs, args.workers, args.microbatches).plan
        choose_ms = 1e3 * (time.perf_counter() - start)
        periods = {
            label: {mode: roundpipe(costs, chosen, args.workers, args.microbatches, asynchronous=mode == "async").period
                    for mode in ("async", "sync")}
            for label, chosen in (("objective", plan), ("fastest", fastest))
        }  # fmt: skip
        b = bubbles("roundpipe-async", costs, args.workers, args.microbatches, plan=fastest)
        results[name]["fastest"] = {"plan": str(fastest), "choose_ms": choose_ms, "roundpipe-async": asdict(b),
                                    "period_s": periods}  # fmt: skip
        print(f"{'roundpipe-async, fastest plan':18} {b.total:7.3f} {b.imbalance:9.3f} {b.structural:10.3f}"
              f"  plan {fastest} ({choose_ms:.0f} ms to choose)")  # fmt: skip
        for label, modes in periods.items():
            async_ms, sync_ms = 1e3 * modes["async"], 1e3 * modes["sync"]
            print(f"  period with the {label} plan: async {async_ms:.1f} ms, sync {sync_ms:.1f} ms")
        start = time.perf_counter()
        partition(widen(costs, 94), args.workers, args.microbatches)
        results[name]["partition_94_layers_ms"] = ms = 1e3 * (time.perf_counter() - start)
        print(f"partitioner: {results[name]['partition_ms']:.1f} ms; 94 layers: {ms:.1f} ms")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        command = "python benchmarks/schedules.py " + " ".join(sys.argv[1:])
        device = torch.cuda.get_device_name(0) if args.device == "cuda" and recorded is None else "cpu"
        meta = {"date": time.strftime("%Y-%m-%d"), "command": command, "device": device}
        if args.costs:
            meta["costs_measured_by"] = json.loads(Path(args.costs).read_text())["meta"]
        out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return
        fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
        for ax, (name, res) in zip(axes[0], results.items()):
            imb = [res[s].get("imbalance", 0.0) * 100 for s in SCHEDULES]
            st = [res[s].get("structural", 0.0) * 100 for s in SCHEDULES]
            ax.bar(SCHEDULES, st, label="structural (fill/drain)")
            ax.bar(SCHEDULES, imb, bottom=st, label="imbalance")
            ax.set_title(f"{name} ({res['simulated_layers']} layers): {args.workers} GPUs x {args.microbatches} mb")
            ax.set_ylabel("bubble ratio (%)")
            ax.tick_params(axis="x", rotation=30)
            ax.legend()
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
