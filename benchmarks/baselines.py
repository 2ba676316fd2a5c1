"""roundpipe against plain training, FSDP CPU offload and DeepSpeed ZeRO-Offload / ZeRO-Infinity, through Lightning.

Every system trains the same randomly initialised model (``benchmarks/qwen3_shape.py``: Qwen3-1.7B or
Qwen3-4B shape, tied embeddings, the chunked LM-head loss) in bf16 with the same tokens per optimizer
step, sequence length ``--seq-len``:

- ``plain``: the model on the GPU, every block checkpointed, ``AdamW(fused=True)`` on the GPU;
- ``fsdp-offload``: ``FSDPStrategy(cpu_offload=True)``, blocks wrapped and checkpointed, fused AdamW on
  the CPU-resident parameters (caveat: torch's FSDP with CPU offload keeps only the last micro-batch's
  gradient under accumulation outside ``no_sync``, which Lightning does not use for FSDP: its speed is
  comparable, its training is not the same);
- ``zero3-offload``: DeepSpeed ZeRO-3 with parameters and optimizer states offloaded (pinned), blocks
  checkpointed, ``DeepSpeedCPUAdam`` (the loss is multiplied back by the accumulation steps, which
  Lightning and DeepSpeed both divide by);
- ``zero2-offload``: DeepSpeed ZeRO-2 with the optimizer offloaded (ZeRO-Offload), ``DeepSpeedCPUAdam``;
- ``roundpipe``: ``RoundPipeStrategy`` (automatic plan, asynchronous optimizer), fused AdamW on the host.

The baselines see micro-batches of ``--micro-batch`` sequences with gradient accumulation; roundpipe
takes the whole step as one batch of ``--seqs // --micro-batch`` micro-batches. ``--gpu-gib`` caps
the card (``torch.cuda.set_per_process_memory_fraction``). One process per configuration (the
``_driver``); a failed configuration is recorded with its error (e.g. out of memory) and the rest go
on. ``--max-seq CONFIG,...`` instead finds each system's longest sequence at micro-batch 1 (fresh
process per probe, doubling then bisecting, 2 optimizer steps each; a time limit or another error ends
the search as inconclusive; the partitioner finding no plan counts as GPU memory). Timing starts
after ``--warmup`` optimizer steps for every system: roundpipe's first two profile one layer per stage,
and its first steps on the chosen plan carry one-off costs (on one H200, ``bubble_check.py`` saw them
within the first 5 steps after the switch), so the default of 8 keeps both out. Run one configuration
per device call: each fits in its 10 minutes, and results are written after every configuration (and
every probe). DeepSpeed comes from wheels carried to the GPU machine (``pip install wheels/*.whl``);
its CPU Adam builds there on first use.

    python benchmarks/baselines.py --out benchmarks/results/baselines.json
    python benchmarks/baselines.py --gpu-gib 24 --out benchmarks/results/baselines-24gb.json
    python benchmarks/baselines.py --max-seq roundpipe,zero2-offload --gpu-gib 24 --out benchmarks/results/maxseq.json

``--device cpu --model debug --configs plain,roundpipe`` is a smoke test.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _driver import run_configs, write
from _zero import zero_offload
from bubble_check import Tokens
from qwen3_shape import SHAPES, Block, build, flops_per_token, init, num_parameters, split_blocks

import lightning_roundpipe
from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.runtime.device import max_memory_allocated, reset_peak_memory_stats

CONFIGS = ("plain", "fsdp-offload", "zero3-offload", "zero2-offload", "roundpipe")
GiB = 2**30


class Model(L.LightningModule):
    """The shaped ``nn.Sequential``; blocks checkpointed under the baselines, pipelined under roundpipe."""

    def __init__(self, shape: Any, optimizer: str, split: bool = False, tile_tokens: int | None = None) -> None:
        super().__init__()
        with torch.device("meta"):
            model = build(shape)
        self.model = init(model.to_empty(device="cpu"))
        if split:  # roundpipe only: the baselines checkpoint whole blocks
            self.model = split_blocks(self.model, tile_tokens)
        self.optimizer = optimizer

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, labels = batch
        if isinstance(self.trainer.strategy, RoundPipeStrategy):
            return lightning_roundpipe.pipeline_loss(
                self.model, (tokens, labels), labels, lambda out, _: out, reduction=lambda t: (t != -100).sum()
            )
        layers = list(self.model.children())
        x = layers[0]((tokens, labels))
        for block in layers[1:-1]:
            x = checkpoint(block, x, use_reentrant=False)
        loss = layers[-1](x)
        from lightning.pytorch.strategies import DeepSpeedStrategy

        if isinstance(self.trainer.strategy, DeepSpeedStrategy):
            # Lightning divides the loss by the accumulation steps and DeepSpeed's backward does again
            loss = loss * self.trainer.accumulate_grad_batches
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "deepspeed-cpu-adam":
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(self.parameters(), lr=1e-5, weight_decay=0.01, adamw_mode=True)
        return torch.optim.AdamW(self.parameters(), lr=1e-5, weight_decay=0.01, fused=True)


class Report(L.Callback):
    """Prints the run's ``RESULT {json}`` line at the end of training (after ``Clock``'s drain)."""

    def __init__(self, measure: Callable[[], dict[str, Any]]) -> None:
        self.measure = measure
        self.result: dict[str, Any] = {}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.result = self.measure()
        print("RESULT " + json.dumps(self.result), flush=True)


class Clock(L.Callback):
    """Optimizer-step timestamps (after the first ``warmup`` steps) and the GPU peak from then on.

    Steady-state throughput is taken between the first and the last stamp. roundpipe's asynchronous
    optimizer lets the main thread return from a step once its losses are known (at most one update
    behind); the work still in flight at the last stamp matches what was in flight at the first. The
    drain at the end of training (the last backward and update) is a one-off cost, reported apart:
    with few timed steps it would otherwise weigh as much as a whole step."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.stamps: list[float] = []
        self.moved: list[tuple[int, int]] = []  # roundpipe: bytes up and down at the first and last stamp
        self.engine: dict[str, Any] = {}  # roundpipe: its plan at the end
        self.drained = 0.0  # when the last step's work had landed

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.fit_loop._should_accumulate():
            return
        if trainer.global_step == self.warmup and torch.cuda.is_available():
            for device in range(torch.cuda.device_count()):
                reset_peak_memory_stats(device)  # and roundpipe's record of what its profiling cleared
        if trainer.global_step >= self.warmup:
            engine = getattr(trainer.strategy, "engine", None)
            if engine is None and torch.cuda.is_available():
                torch.cuda.synchronize()  # the baselines' queued GPU work belongs to this step
            self.stamps.append(time.perf_counter())
            if engine is not None:
                now = engine.crew.transferred_bytes()
                self.moved = [self.moved[0] if self.moved else now, now]

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            engine.flush()  # roundpipe: the last update lands inside the timed window
        elif torch.cuda.is_available():
            torch.cuda.synchronize()
        self.drained = time.perf_counter()
        if engine is not None and self.moved:
            self.moved[-1] = engine.crew.transferred_bytes()
            costs = None if engine.planner.layer_costs is None else asdict(engine.planner.layer_costs)
            self.engine = {"plan": str(engine.plan), "predicted_bubble": engine.planner.predicted_bubble,
                           "workers": engine.num_workers, "handoff_s": engine.stats.handoff,
                           "layer_costs": costs,  # what the plan was made from
                           # where the host memory went: model states, and all that is page-locked
                           # (the states' compute copies and gradients, plus the pool's buffers in transit)
                           "store_gib": engine.store.nbytes() / GiB, "pinned_gib": engine.pool.pinned_bytes / GiB,
                           "pool_gib": engine.pool.buffer_bytes / GiB}  # fmt: skip


def strategy_for(
    config: str,
    accumulate: int,
    double_buffer: str = "none",
    gpu_memory: float = 0.8,
    micro_batch: int = 1,
    capped: bool = False,
) -> tuple[Any, str]:
    """The Lightning strategy and optimizer of ``config``; ``capped``: the card is capped (``--gpu-gib``)."""
    from lightning.pytorch.strategies import FSDPStrategy

    if config == "plain":
        return "auto", "fused-adamw"
    if config == "roundpipe":
        strategy = RoundPipeStrategy(num_microbatches=accumulate, double_buffer=double_buffer, gpu_memory=gpu_memory)
        return strategy, "fused-adamw"
    if config == "fsdp-offload":
        from torch.distributed.fsdp import MixedPrecision

        strategy = FSDPStrategy(
            cpu_offload=True, auto_wrap_policy={Block}, activation_checkpointing_policy=None,
            sharding_strategy="FULL_SHARD", limit_all_gathers=True, use_orig_params=True,
            mixed_precision=MixedPrecision(torch.bfloat16, torch.float32, torch.float32),  # fp32 rotary tables
        )  # fmt: skip
        return strategy, "fused-adamw"
    if config in ("zero2-offload", "zero3-offload"):
        return zero_offload(int(config[4]), capped, logging_batch_size_per_gpu=micro_batch), "deepspeed-cpu-adam"
    raise ValueError(f"unknown configuration {config!r}; choose from {CONFIGS}")


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    shape = SHAPES[args.model]
    cuda = args.device == "cuda"
    if cuda and args.gpu_gib:
        for device in range(torch.cuda.device_count()):  # every card roundpipe's workers may use
            torch.cuda.set_per_process_memory_fraction(
                args.gpu_gib * GiB / torch.cuda.get_device_properties(device).total_memory, device
            )
    if cuda and args.memory_snapshot:
        from memory_snapshot import record_until_out_of_memory

        record_until_out_of_memory(args.memory_snapshot)
    roundpipe = args.run == "roundpipe"
    if args.seqs % args.micro_batch:
        raise SystemExit(f"--seqs {args.seqs} is not a multiple of --micro-batch {args.micro_batch}")
    accumulate = max(1, args.seqs // args.micro_batch)
    strategy, optimizer = strategy_for(
        args.run, accumulate, args.double_buffer, args.gpu_memory, args.micro_batch, capped=bool(args.gpu_gib)
    )
    L.seed_everything(0, verbose=False)
    split = args.split_blocks and roundpipe  # the baselines checkpoint whole blocks either way
    if args.tile_tokens and not args.split_blocks:
        raise SystemExit("--tile-tokens tiles the layers of --split-blocks; pass both")
    tile = args.tile_tokens if split else None
    module = Model(shape, optimizer, split=split, tile_tokens=tile)
    parameters = num_parameters(module.model)  # before fit: ZeRO-3 leaves partitioned (empty) parameters
    steps = args.warmup + args.steps
    batch = args.seqs if roundpipe else args.micro_batch
    data = DataLoader(Tokens(shape, args.seqs * steps, args.seq_len), batch_size=batch)
    clock = Clock(args.warmup)

    def measured() -> dict[str, Any]:
        seconds = clock.stamps[-1] - clock.stamps[0]
        timed = len(clock.stamps) - 1
        tokens_per_s = args.seqs * args.seq_len * timed / seconds
        with_drain = args.seqs * args.seq_len * timed / (clock.drained - clock.stamps[0])
        peaks = [max_memory_allocated(d) / GiB for d in range(torch.cuda.device_count())] if cuda else []
        moved = {}
        if roundpipe and len(clock.moved) == 2:
            (up0, down0), (up1, down1) = clock.moved
            moved = {
                "h2d_gb_s": (up1 - up0) / 1e9 / seconds,
                "d2h_gb_s": (down1 - down0) / 1e9 / seconds,
                **clock.engine,
            }
        return {
            **moved,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_with_drain": with_drain,
            "drain_s": clock.drained - clock.stamps[-1],
            "step_s": seconds / timed,
            "step_times_s": [b - a for a, b in zip(clock.stamps, clock.stamps[1:])],  # a one-off shows here
            "model_tflops": tokens_per_s * flops_per_token(shape, args.seq_len, recompute=True) / 1e12,
            "peak_gpu_gib": max(peaks, default=0.0),
            "peak_gpu_gib_per_device": peaks,
            "peak_host_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB,
            "parameters": parameters,
            "model": args.model,
            "gpu_cap_gib": args.gpu_gib or None,
            "seq_len": args.seq_len,
            **({"split_blocks": True} if split else {}),
            **({"tile_tokens": tile} if tile else {}),
        }

    # printed before Lightning tears the strategy down: freeing tens of GB of pinned host memory can
    # take long enough that a time limit would otherwise lose a finished measurement
    report = Report(measured)
    trainer = L.Trainer(
        strategy=strategy, accelerator="gpu" if cuda else "cpu", devices=args.workers if roundpipe else 1,
        precision="bf16-mixed", max_steps=steps, accumulate_grad_batches=1 if roundpipe else accumulate,
        logger=False, callbacks=[clock, report], enable_progress_bar=False, enable_checkpointing=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, data)
    return report.result


def probe(args: argparse.Namespace, config: str, seq_len: int) -> tuple[bool, str, str]:
    """One fresh process at ``seq_len``, micro-batch 1, 2 optimizer steps: did it fit, and what ran out.
    roundpipe gets one sequence per worker (a round needs a micro-batch for each) and 2 more steps: its
    automatic plan profiles 2 batches one layer per stage, and the plan it then picks must fit too.
    Returns (fits, what ran out, the error's last line: e.g. allocated and reserved GPU memory)."""
    roundpipe = config == "roundpipe"
    cmd = [sys.executable, __file__, "--run", config, "--model", args.model, "--device", args.device,
           "--seqs", str(args.workers if roundpipe else 1), "--micro-batch", "1", "--seq-len", str(seq_len),
           "--steps", "1", "--warmup", "3" if roundpipe else "1", "--workers", str(args.workers)]  # fmt: skip
    cmd += ["--double-buffer", args.double_buffer, "--gpu-memory", str(args.gpu_memory)]
    cmd += ["--split-blocks"] if args.split_blocks else []
    cmd += ["--tile-tokens", str(args.tile_tokens)] if args.tile_tokens else []
    if args.gpu_gib:
        cmd += ["--gpu-gib", str(args.gpu_gib)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.probe_timeout,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    except subprocess.TimeoutExpired as expired:
        out = expired.stdout.decode(errors="replace") if isinstance(expired.stdout, bytes) else expired.stdout
        if "RESULT " in (out or ""):  # training finished; only the teardown after it ran out of time
            return True, "", ""
        return False, "time limit", ""
    if proc.returncode == 0 and "RESULT " in proc.stdout:
        return True, "", ""
    err = proc.stderr[-4000:]
    lines = [line for line in err.strip().splitlines() if "Error" in line or "Infeasible" in line]
    detail = (lines or err.strip().splitlines() or [""])[-1][:600]
    if "CUDA out of memory" in err or "OutOfMemoryError" in err or "CUDA error: out of memory" in err:
        return False, "GPU memory", detail
    if "partition.Infeasible" in err:  # roundpipe's partitioner: one layer's stage alone exceeds the card
        return False, "GPU memory (no plan fits)", detail
    if proc.returncode in (-9, 137) or "Cannot allocate memory" in err or "MemoryError" in err:
        return False, "host memory", detail
    return False, "error: " + detail[:200] if detail else f"exit {proc.returncode}", detail


MEMORY = ("GPU memory", "GPU memory (no plan fits)", "host memory")


def max_seq(
    args: argparse.Namespace, config: str, report: Callable[[dict[str, Any]], None] = lambda _: None
) -> dict[str, Any]:
    """Double from ``--seq-len`` until a probe fails, then bisect to ``--seq-step`` tokens. ``report`` gets
    the answer so far after every probe, so a command stopped from outside keeps what it learnt."""
    good, bad, why, seq, details, probes = 0, None, "", args.seq_len, {}, []
    roundpipe = config == "roundpipe"

    def answer(**extra: Any) -> dict[str, Any]:
        return {"config": config, "max_seq_len": good, "first_failure": bad, "ran_out_of": why, "cap": args.seq_cap,
                "workers": args.workers, "model": args.model, "gpu_cap_gib": args.gpu_gib or None,
                "failure_detail": details.get(bad, ""), "probes": probes,
                **({"split_blocks": True} if roundpipe and args.split_blocks else {}),
                **({"tile_tokens": args.tile_tokens} if roundpipe and args.tile_tokens else {}),
                **extra}  # fmt: skip

    def run(seq: int) -> bool:
        ok, reason, details[seq] = probe(args, config, seq)
        print(f"{config}: {seq} tokens {'fits' if ok else 'fails (' + reason + ')'}", flush=True)
        probes.append({"seq_len": seq, "fits": ok, **({} if ok else {"ran_out_of": reason})})
        return ok

    while bad is None and seq <= args.seq_cap:
        if run(seq):
            good, seq = seq, seq * 2
        else:
            bad, why = seq, probes[-1]["ran_out_of"]
        report(answer(searching=True))
    if why not in ("", *MEMORY):  # a time limit or an error: no bisection on that
        return answer(inconclusive=True)
    while bad is not None and bad - good > args.seq_step:
        mid = (good + bad) // 2 // args.seq_step * args.seq_step or args.seq_step
        if mid <= good:
            break
        if run(mid):
            good = mid
        elif probes[-1]["ran_out_of"] not in MEMORY:  # a time limit or an error: the bracket stays open
            return answer(inconclusive=True)
        else:
            bad, why = mid, probes[-1]["ran_out_of"]
        report(answer(searching=True))
    return answer()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", choices=CONFIGS, help="run one configuration in this process")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--max-seq", default=None, help="configurations whose longest sequence to find instead")
    p.add_argument("--model", default="qwen3-1.7b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--workers", type=int, default=1, help="roundpipe workers (GPUs)")
    p.add_argument("--gpu-memory", type=float, default=0.8, help="roundpipe: share of the card the plan may use")
    p.add_argument("--memory-snapshot", default=None, help="at an out-of-memory, write the allocator's state here")
    p.add_argument(
        "--double-buffer", default="none", choices=("none", "first", "all"), help="RoundPipeStrategy(double_buffer=...)"
    )
    p.add_argument(
        "--split-blocks", action="store_true", help="roundpipe's model: each block as two layers (attention, MLP)"
    )
    p.add_argument(
        "--tile-tokens", type=int, default=0, help="with --split-blocks: token-wise parts over at most N tokens at once"
    )
    p.add_argument("--gpu-gib", type=float, default=0.0, help="emulate a card of this many GiB")
    p.add_argument("--seqs", type=int, default=32, help="sequences per optimizer step")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=8, help="optimizer steps before timing starts (all systems)")
    p.add_argument("--seq-cap", type=int, default=262144)
    p.add_argument("--seq-step", type=int, default=1024)
    p.add_argument("--probe-timeout", type=int, default=300)
    p.add_argument("--config-timeout", type=int, default=0, help="seconds per configuration (0: no limit)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.run:
        run_one(args)  # prints its RESULT line
        return
    if args.max_seq:
        results = []
        for config in args.max_seq.split(","):
            results.append(
                max_seq(args, config, lambda partial: write(args.out, sys.argv[1:], __file__, [*results, partial]))
            )
            print("RESULT " + json.dumps(results[-1]), flush=True)
            write(args.out, sys.argv[1:], __file__, results)
        return
    shared = {k: v for k, v in vars(args).items() if k not in ("run", "configs", "out", "max_seq")}
    results = []
    for config in args.configs.split(","):  # written after each one: a killed command keeps what finished
        results += run_configs(__file__, [config], shared, timeout=args.config_timeout or None)
        print("RESULT " + json.dumps(results[-1]), flush=True)
        write(args.out, sys.argv[1:], __file__, results)
    by = {r["config"]: r for r in results if "error" not in r}
    print(f"\n{'config':15} {'tokens/s':>9} {'TFLOP/s':>8} {'GPU GiB':>8} {'host GiB':>9}  roundpipe/this")
    for r in results:
        if "error" in r:
            print(f"{r['config']:15} failed")
            continue
        ratio = by["roundpipe"]["tokens_per_s"] / r["tokens_per_s"] if "roundpipe" in by else float("nan")
        r["roundpipe_over_this"] = ratio
        print(f"{r['config']:15} {r['tokens_per_s']:9.0f} {r['model_tflops']:8.1f} {r['peak_gpu_gib']:8.2f}"
              f" {r['peak_host_gib']:9.2f}  {ratio:.2f}")  # fmt: skip
    write(args.out, sys.argv[1:], __file__, results)


if __name__ == "__main__":
    main()
