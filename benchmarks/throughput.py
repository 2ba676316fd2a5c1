"""Forward+backward throughput of roundpipe on one GPU against plain on-GPU training, side by side.

Each configuration runs in its own process (clean peak-memory numbers), on a randomly initialised
model with Qwen3's shapes (``benchmarks/qwen3_shape.py``), bf16, the chunked LM-head loss:

- ``plain``: the model on the GPU, fp32 weights under bf16 autocast, activation checkpointing of
  every decoder block, fused AdamW on the GPU.
- ``roundpipe-priority`` / ``-simple`` / ``-none``: the engine on one GPU with weights, gradients and
  stage inputs on the host, and weight/gradient transfers placed by priority-aware parts, one-piece
  prefetch, or no overlap (the ablation of paper Figure 18).
- ``roundpipe-4b-24gb``: a Qwen3-4B-shaped full fine-tune (host AdamW) on an emulated 24 GB card.

``--device cpu --model debug`` is a smoke test (CPU worker threads; no memory numbers).

    python benchmarks/throughput.py --out benchmarks/results/throughput.json
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _driver import add_in_process_flag, run_or_drive, write
from qwen3_shape import SHAPES, Shape, build, flops_per_token, init, num_parameters

from lightning_roundpipe.runtime.device import max_memory_allocated, reset_peak_memory_stats


def profile_step(step: Any, out_dir: str | None, name: str) -> dict[str, Any]:
    """Run ``step()`` under the profiler (device activity only: host-side tracing of every op would slow
    the host issuing kernels, the very thing under test); return the device's busy fractions, its idle
    gaps by length with the largest ones located, and write the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    wall_us = (time.perf_counter() - t0) * 1e6
    kernels, copies = device_events(prof)

    def union(intervals: list[tuple[float, float, str]]) -> float:
        total, end = 0.0, float("-inf")
        for a, b, _ in sorted(intervals):
            if b > end:
                total += b - max(a, end)
                end = b
        return total

    if out_dir:
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        Path(out_dir, f"profile-{name}.txt").write_text(table)
    # Fractions of the device's own span (first to last event): the wall around the profiler also holds
    # its start and its processing of the trace at exit (a roundpipe step of 32k kernels, 2026-12-01:
    # 3.45 s of wall around a 2.62 s device span, against 2.75 s for the step unprofiled).
    events = kernels + copies
    span_us = max(b for _, b, _ in events) - min(a for a, _, _ in events) if events else wall_us
    return {
        "kernel_busy": union(kernels) / span_us,
        "copy_busy": union(copies) / span_us,
        "kernel_sum_s": sum(b - a for a, b, _ in kernels) / 1e6,
        "device_span_s": span_us / 1e6,
        "profiled_s": wall_us / 1e6,
        "kernel_gaps": kernel_gaps(kernels),
        "kernel_kinds": kernel_kinds(kernels, copies),
    }


KINDS = (
    ("attention", ("flash", "fmha", "attention", "attn", "sdpa", "mha")),
    ("matrix products", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "sm90", "sm80", "matmul", "wgmma")),
    ("loss", ("cross_entropy", "log_softmax", "nll_loss", "logsumexp")),
    ("norms", ("rms", "norm")),
    ("element-wise and reductions", ("elementwise", "vectorized", "reduce", "unrolled", "silu", "swiglu", "rope",
                                     "mul", "add", "copy", "cat", "index", "scatter", "gather", "where", "exp")),
)  # fmt: skip
"""Kernel kinds by name, first match wins (cuBLAS, cuDNN, flash-attention and Triton kernels all name
themselves so); what none matches is "other"."""


def kernel_kinds(kernels: list[tuple[float, float, str]], copies: list[tuple[float, float, str]]) -> dict[str, Any]:
    """Device seconds by kind of kernel in one profiled window (the sum of their durations, streams
    overlapping), the copies' seconds, the idle between kernels and the window's span: where a stage's
    time goes."""
    out: dict[str, float] = {"copies": sum(b - a for a, b, _ in copies) / 1e6}
    by_name: dict[str, dict[str, float]] = {}
    events = kernels + copies
    for a, b, name in kernels:
        lower = name.lower()
        kind = next((k for k, keys in KINDS if any(key in lower for key in keys)), "other")
        out[kind] = out.get(kind, 0.0) + (b - a) / 1e6
        names = by_name.setdefault(kind, {})
        names[name[:100]] = names.get(name[:100], 0.0) + (b - a) / 1e6
    gaps = kernel_gaps(kernels)
    idle = sum(v["seconds"] for v in gaps.get("by_length", {}).values())
    span = (max(b for _, b, _ in events) - min(a for a, _, _ in events)) / 1e6 if events else 0.0
    top = {k: dict(sorted(v.items(), key=lambda kv: -kv[1])[:4]) for k, v in by_name.items()}
    # which kernels a kind's seconds are (the attention backend that ran, say)
    return {"seconds_by_kind": out, "idle_between_kernels_s": idle, "span_s": span, "top_kernels": top}


def device_events(prof: Any) -> tuple[list[tuple[float, float, str]], list[tuple[float, float, str]]]:
    """A profiler's device kernels and copies as (start us, end us, name)."""
    kernels, copies = [], []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start:
            row = (e.time_range.start, e.time_range.end, e.name)
            (copies if "memcpy" in e.name.lower() else kernels).append(row)
    return kernels, copies


GAP_BUCKETS_US = (20.0, 200.0, 2000.0)


def kernel_gaps(kernels: list[tuple[float, float, str]], top: int = 8) -> dict[str, Any]:
    """The device's idle between kernels (any stream) in one profiled step: count and seconds by gap
    length (microseconds), and the ``top`` largest with their place and the kernels around them."""
    rows = sorted(kernels)
    if not rows:
        return {}
    origin, end, before = rows[0][0], rows[0][1], rows[0][2]
    buckets = {f"<{b:g}us": [0, 0.0] for b in GAP_BUCKETS_US} | {f">={GAP_BUCKETS_US[-1]:g}us": [0, 0.0]}
    gaps = []
    for a, b, kernel in rows[1:]:
        if a > end:
            gap = a - end
            label = next((f"<{x:g}us" for x in GAP_BUCKETS_US if gap < x), f">={GAP_BUCKETS_US[-1]:g}us")
            buckets[label][0] += 1
            buckets[label][1] += gap / 1e6
            gaps.append((gap, end - origin, before[:60], kernel[:60]))
        if b > end:
            end, before = b, kernel
    gaps.sort(reverse=True)
    return {
        "span_s": (end - origin) / 1e6,
        "by_length": {k: {"count": n, "seconds": s} for k, (n, s) in buckets.items()},
        "largest": [{"ms": g / 1e3, "at_ms": t / 1e3, "after": x, "before": y} for g, t, x, y in gaps[:top]],
    }


def host_add_speed(numel: int) -> dict[str, float]:
    """Elements per second (G) of the collector's host work, ``fp32 += bf16`` over ``numel`` elements
    (the tied embedding's second gradient write), on the main thread and on a fresh thread as the
    collectors run it. Each element reads 6 bytes and writes 4."""
    import threading

    acc = torch.zeros(numel, dtype=torch.float32).pin_memory()
    staged = torch.ones(numel, dtype=torch.bfloat16).pin_memory()
    out: dict[str, float] = {"threads": float(torch.get_num_threads())}

    def timed(key: str) -> None:
        acc.add_(staged)  # touch the pages once
        t0 = time.perf_counter()
        for _ in range(3):
            acc.add_(staged)
        out[key] = 3 * numel / 1e9 / (time.perf_counter() - t0)

    timed("main_gelem_s")
    thread = threading.Thread(target=timed, args=("thread_gelem_s",))
    thread.start()
    thread.join()
    return out


CONFIGS = ("plain", "roundpipe-priority", "roundpipe-simple", "roundpipe-none", "roundpipe-4b-24gb")
GiB = 1024**3


def batch(shape: Shape, seqs: int, seq_len: int, seed: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, shape.vocab, (seqs, seq_len + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def default_plan(num_layers: int, fused_blocks: int) -> str:
    """Forward stages of 3 layers, a fused stage of the head and ``fused_blocks`` blocks, backward stages of 1."""
    fused = 1 + fused_blocks
    rest = num_layers - fused
    forward = [3] * (rest // 3) + ([rest % 3] if rest % 3 else [])
    return ",".join(map(str, forward)) + "|" + ",".join(map(str, [fused] + [1] * rest))


def _sync(args: argparse.Namespace) -> None:
    if args.device == "cuda":
        torch.cuda.synchronize()


def _reset_peak(args: argparse.Namespace) -> None:
    if args.device == "cuda":
        reset_peak_memory_stats()  # and the record of peaks the layer profiling cleared


def _peak_gib(args: argparse.Namespace) -> float:
    return max_memory_allocated() / GiB if args.device == "cuda" else 0.0


def run_plain(args: argparse.Namespace, shape: Shape) -> dict[str, Any]:
    from torch.utils.checkpoint import checkpoint

    if args.device == "cuda":
        torch.cuda.set_device(0)
    with torch.device(args.device):
        model = init(build(shape))
    layers = list(model.children())

    def forward(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.autocast(args.device, dtype=torch.bfloat16):
            x = layers[0]((tokens, labels))
            for block in layers[1:-1]:
                x = checkpoint(block, x, use_reentrant=False)
            return layers[-1](x)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    fwd_bwd, opt_times = [], []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            _reset_peak(args)
        tokens, labels = batch(shape, args.seqs, args.seq_len, step, args.device)
        _sync(args)
        t0 = time.perf_counter()
        forward(tokens, labels).backward()
        _sync(args)
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(args)
        if step >= args.warmup:
            fwd_bwd.append(t1 - t0)
            opt_times.append(time.perf_counter() - t1)
    profiled = {}
    if args.profile:

        def one() -> None:
            tokens, labels = batch(shape, args.seqs, args.seq_len, 999, args.device)
            forward(tokens, labels).backward()
            opt.zero_grad(set_to_none=True)

        profiled = profile_step(one, args.profile, "plain")
    return {
        **profiled,
        "fwd_bwd_s": fwd_bwd,
        "optimizer_s": opt_times,
        "peak_gpu_gib": _peak_gib(args),
        "parameters": num_parameters(model),
        "host_rss_gib": psutil.Process().memory_info().rss / GiB,
        "recompute": True,
    }


def run_roundpipe(args: argparse.Namespace, shape: Shape, overlap: str, optimizer_steps: int) -> dict[str, Any]:
    from lightning_roundpipe.engine import PipelineEngine
    from lightning_roundpipe.runtime import WorkerDevice
    from lightning_roundpipe.runtime.device import CudaWorkerDevice
    from lightning_roundpipe.runtime.profile import idle_gaps
    from lightning_roundpipe.schedule import StagePlan

    if args.device == "cuda":
        torch.cuda.set_device(0)
    if args.gpu_gib and args.device == "cuda":
        torch.cuda.set_per_process_memory_fraction(
            args.gpu_gib * GiB / torch.cuda.get_device_properties(0).total_memory
        )
    rss0 = psutil.Process().memory_info().rss
    with torch.device("meta"):
        model = build(shape)
    model = init(model.to_empty(device="cpu"))
    params = num_parameters(model)
    plan = StagePlan.parse(args.plan or default_plan(len(model), args.fused_blocks))
    assert args.seqs % args.micro_batch == 0, "--seqs must be a multiple of --micro-batch"
    engine = PipelineEngine(
        list(model.children()),
        [CudaWorkerDevice("cuda:0", 0) if args.device == "cuda" else WorkerDevice("cpu", 0)],
        plan=plan,
        microbatches_per_round=args.seqs // args.micro_batch,
        compute_dtype=torch.bfloat16,
        autocast_dtype=torch.bfloat16,
        overlap=overlap,  # type: ignore[arg-type]
        max_inflight=args.max_inflight,
    )
    del model
    gc.collect()

    def count(labels: torch.Tensor) -> torch.Tensor:
        return (labels != -100).sum()

    def step(i: int) -> float:
        tokens, labels = batch(shape, args.seqs, args.seq_len, i)
        t0 = time.perf_counter()
        engine.train_batch((tokens, labels), labels, lambda out, _: out, reduction=count)
        return time.perf_counter() - t0

    try:
        fwd_bwd = []
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                _reset_peak(args)
                up0, down0 = engine.crew.transferred_bytes()
            elapsed = step(i)
            if i >= args.warmup:
                fwd_bwd.append(elapsed)
            engine.store.clear_grads()
        up, down = engine.crew.transferred_bytes()
        timed = sum(fwd_bwd)
        result: dict[str, Any] = {
            "fwd_bwd_s": fwd_bwd,
            "peak_gpu_gib": _peak_gib(args),
            "parameters": params,
            "plan": str(plan),
            "microbatches": args.seqs // args.micro_batch,
            "h2d_gb_per_step": (up - up0) / 1e9 / args.steps,
            "d2h_gb_per_step": (down - down0) / 1e9 / args.steps,
            "h2d_gb_s": (up - up0) / 1e9 / timed,
            "d2h_gb_s": (down - down0) / 1e9 / timed,
            "store_bytes_per_param": engine.store.nbytes() / params,
            "pinned_gib": engine.pool.pinned_bytes / GiB,
        }
        # one more step with the engine's timers: the device's idle between its actions, by what came next
        engine.planner.measure_next()
        logs: list[tuple[float, float, float, int]] = []
        engine.crew.log_gradient_adds(logs)
        t0 = time.perf_counter()
        step(998)
        t1 = time.perf_counter()
        engine.crew.log_gradient_adds(None)
        engine.store.clear_grads()
        rows = engine.stats.last_timeline
        result["recorded_step_s"] = max(r[3] for r in rows) - min(r[2] for r in rows)
        result["recorded_busy_s"] = sum(r[3] - r[2] for r in rows)
        result["idle_gaps"] = idle_gaps(rows)
        result["anatomy"] = step_anatomy(t0, t1, engine.stats.last_timeline_origin, rows, logs)
        if args.profile:
            result.update(profile_step(lambda: step(999), args.profile, args.run))
            engine.store.clear_grads()
        if optimizer_steps:
            opt = torch.optim.AdamW(engine.store.parameters, lr=1e-5, fused=True)
            steps, parts = [], []
            for i in range(optimizer_steps):
                t0 = time.perf_counter()
                step(1000 + i)
                t1 = time.perf_counter()
                engine.store.install_grads()
                opt.step()
                t2 = time.perf_counter()
                engine.store.clear_grads()
                t3 = time.perf_counter()
                engine.store.mark_dirty()
                engine.store.sync_compute()
                t4 = time.perf_counter()
                steps.append(t4 - t0)
                parts.append({"fwd_bwd": t1 - t0, "adamw": t2 - t1, "zero_grads": t3 - t2, "refresh_bf16": t4 - t3})
            states = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim())
            result["full_step_s"] = steps
            result["full_step_parts_s"] = parts
            result["host_bytes_per_param"] = (engine.store.nbytes() + states) / params
        result["host_rss_gib"] = (psutil.Process().memory_info().rss - rss0) / GiB
        if args.device == "cuda":
            result["host_add"] = host_add_speed(shape.vocab * shape.hidden)
        return result
    finally:
        engine.close()


def step_anatomy(
    t0: float, t1: float, origin: float, rows: list[tuple[int, str, float, float]],
    adds: list[tuple[float, float, float, int]],
) -> dict[str, Any]:  # fmt: skip
    """Where a synchronous step's wall time goes outside the device's compute: ``head_s`` from the call
    to the first compute, ``tail_s`` from the last compute to the return, and in the tail the host
    gradient sums (the collectors' jobs ending after the last compute)."""
    first, last = origin + min(r[2] for r in rows), origin + max(r[3] for r in rows)
    late = [a for a in adds if a[2] > last]
    return {
        "head_s": first - t0,
        "tail_s": t1 - last,
        "host_add_s": sum(c - b for _, b, c, _ in adds),
        "host_add_gb": sum(n for *_, n in adds) / 1e9,
        "tail_jobs": [
            {"copy_done_s": b - last, "add_s": c - b, "end_s": c - last, "gb": n / 1e9} for _, b, c, n in late
        ],
    }


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    config, _, overrides = args.run.partition("@")
    for item in filter(None, overrides.split(",")):  # e.g. roundpipe-priority@micro_batch=8,max_inflight=4
        key, value = item.split("=")
        setattr(args, key, type(getattr(args, key))(value))
    if config == "plain":
        out = run_plain(args, SHAPES[args.model])
    elif config == "roundpipe-4b-24gb":
        args.gpu_gib, args.seqs = 24, args.seqs_4b
        out = run_roundpipe(args, SHAPES["qwen3-4b"], "priority", optimizer_steps=2)
        out["model"] = "qwen3-4b"
    else:
        out = run_roundpipe(args, SHAPES[args.model], config.split("-", 1)[1], args.optimizer_steps)
    out.setdefault("model", args.model)
    out.update(config=args.run, seqs=args.seqs, seq_len=args.seq_len, micro_batch=args.micro_batch)
    tokens = args.seqs * args.seq_len
    out["tokens_per_s"] = tokens * len(out["fwd_bwd_s"]) / sum(out["fwd_bwd_s"])
    shape = SHAPES[out["model"]]
    out["model_tflops"] = flops_per_token(shape, args.seq_len, recompute=False) * out["tokens_per_s"] / 1e12
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--run",
        help=f"run one configuration in this process: one of {CONFIGS}, optionally with"
        " overrides of the options below, e.g. 'roundpipe-priority@micro_batch=8'",
    )
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--model", default="qwen3-1.7b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke test of the script")
    p.add_argument("--seqs", type=int, default=32, help="sequences per step")
    p.add_argument("--seqs-4b", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per micro-batch (roundpipe)")
    p.add_argument("--fused-blocks", type=int, default=4, help="decoder blocks in the fused stage")
    p.add_argument("--plan", default=None)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--optimizer-steps", type=int, default=1)
    p.add_argument("--max-inflight", type=int, default=3, help="micro-batches a worker runs ahead of its GPU")
    p.add_argument("--gpu-gib", type=float, default=0.0, help="emulate a card of this many GiB")
    p.add_argument("--profile", default=None, help="profile one extra step; write kernel tables to this folder")
    p.add_argument("--out", default=None)
    add_in_process_flag(p)
    args = p.parse_args()

    command = sys.argv[1:]
    results = run_or_drive(__file__, args, run_one, lambda done: write(args.out, command, __file__, done))
    if results is None:  # this process measured one configuration
        return
    for r in results:
        if "error" not in r:
            print(f"{r['config']}: {r['tokens_per_s']:.0f} tokens/s, peak GPU {r['peak_gpu_gib']:.1f} GiB")
            if "idle_gaps" in r:
                gaps = ", ".join(
                    f"{kind} {g['seconds']:.3f} s in {g['count']:.0f} (largest {1e3 * g['largest']:.1f} ms)"
                    for kind, g in r["idle_gaps"].items()
                )
                step_s, busy_s = r["recorded_step_s"], r["recorded_busy_s"]
                print(f"  a recorded step: {step_s:.3f} s, busy {busy_s:.3f} s; idle: {gaps}")
                a = r["anatomy"]
                tail = "; ".join(
                    f"{j['gb']:.2f} GB copied by +{1e3 * j['copy_done_s']:.0f} ms, added in {1e3 * j['add_s']:.0f} ms"
                    for j in a["tail_jobs"]
                    if j["gb"] or j["end_s"] > 1e-3
                )
                print(
                    f"  call to first compute {1e3 * a['head_s']:.0f} ms, last compute to return"
                    f" {1e3 * a['tail_s']:.0f} ms (host adds ending after the last compute: {tail or 'none'});"
                    f" host adds in the step {a['host_add_s']:.3f} s for {a['host_add_gb']:.2f} GB"
                )
            if "host_add" in r:
                h = r["host_add"]
                print(f"  host fp32 += bf16: {h['main_gelem_s']:.2f} G elements/s main thread,"
                      f" {h['thread_gelem_s']:.2f} in a thread ({h['threads']:.0f} intra-op threads)")  # fmt: skip
            if r.get("kernel_gaps"):
                k = r["kernel_gaps"]
                lengths = ", ".join(f"{b} {v['count']} = {v['seconds']:.3f} s" for b, v in k["by_length"].items())
                print(f"  profiled: kernels {r['kernel_sum_s']:.3f} s in a {k['span_s']:.3f} s span; gaps {lengths}")
                for g in k["largest"][:4]:
                    print(f"    gap {g['ms']:.2f} ms at {g['at_ms']:.0f} ms: {g['after']} -> {g['before']}")

    plain = next((r for r in results if r.get("config") == "plain" and "error" not in r), None)
    for r in results:
        r.setdefault("model", args.model)
    print(f"\n{'config':22} {'tok/s':>8} {'ratio':>6} {'TFLOP/s':>8} {'GPU GiB':>8} {'GPU/plain':>9} "
          f"{'H2D GB/s':>8} {'D2H GB/s':>8} {'host B/p':>8}")  # fmt: skip
    for r in results:
        if "error" in r:
            print(f"{r['config'][:22]:22} failed")
            continue
        same_model = plain is not None and r["model"] == plain["model"]
        ratio = r["tokens_per_s"] / plain["tokens_per_s"] if same_model else float("nan")
        mem = r["peak_gpu_gib"] / plain["peak_gpu_gib"] if same_model and plain["peak_gpu_gib"] else float("nan")
        r["ratio_to_plain"], r["gpu_memory_ratio_to_plain"] = ratio, mem
        print(
            f"{r['config'][:22]:22} {r['tokens_per_s']:8.0f} {ratio:6.3f} {r['model_tflops']:8.1f}"
            f" {r['peak_gpu_gib']:8.2f} {mem:9.3f} {r.get('h2d_gb_s', 0):8.1f} {r.get('d2h_gb_s', 0):8.1f}"
            f" {r.get('host_bytes_per_param', r.get('store_bytes_per_param', 0)):8.1f}"
        )
    write(args.out, command, __file__, results)


if __name__ == "__main__":
    main()
