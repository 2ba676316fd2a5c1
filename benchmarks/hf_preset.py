"""The Hugging Face Qwen3 preset against the hand-written Qwen3-shaped ``nn.Sequential``, side by side.

Both train through the same engine on one GPU (bf16, random weights, same shape, same plan shape,
the chunked loss); the preset runs transformers' own ``Qwen3ForCausalLM`` blocks. Prints forward+
backward tokens/s of each and their ratio (target: the preset within 5% of the hand-written model).
``--device cpu --model debug`` is a smoke test on CPU worker threads.

    python benchmarks/hf_preset.py --out benchmarks/results/hf-preset.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _driver import add_in_process_flag, run_or_drive, write
from qwen3_shape import SHAPES, build, init, init_hf, num_parameters
from throughput import batch, default_plan

from lightning_roundpipe.runtime.device import max_memory_allocated

CONFIGS = ("handwritten", "preset", "preset-padded")
"""``preset-padded``: the preset with a padding mask (the last 64 tokens of one sequence per micro-batch
padded), the case where transformers' mask code used to wait for the GPU in every block."""


def hf_model(shape: Any) -> torch.nn.Module:
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, tie_word_embeddings=True, attn_implementation="sdpa", rope_theta=1_000_000.0,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(config)
    model = model.to_empty(device="cpu")
    model.lm_head.weight = model.model.embed_tokens.weight
    init_hf(model, config)
    return model


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    from lightning_roundpipe.engine import PipelineEngine
    from lightning_roundpipe.models import hf
    from lightning_roundpipe.runtime import WorkerDevice
    from lightning_roundpipe.runtime.device import CudaWorkerDevice
    from lightning_roundpipe.schedule import StagePlan

    shape = SHAPES[args.model]
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    preset = args.run.startswith("preset")
    if preset:
        model = hf_model(shape)
        layers = hf.build_layers(model)
    else:
        with torch.device("meta"):
            model = build(shape)
        model = init(model.to_empty(device="cpu"))
        layers = list(model.children())
    params = num_parameters(model)
    devices = [CudaWorkerDevice("cuda:0", 0) if cuda else WorkerDevice("cpu", i) for i in range(args.workers)]
    engine = PipelineEngine(
        layers,
        devices,
        plan=StagePlan.parse(default_plan(len(layers), args.fused_blocks)),
        microbatches_per_round=max(args.workers, args.seqs // args.micro_batch),
        compute_dtype=torch.bfloat16,
        autocast_dtype=torch.bfloat16,
    )

    def step(i: int) -> float:
        tokens, labels = batch(shape, args.seqs, args.seq_len, i)
        if preset:  # what the Interceptor passes for `model(input_ids=..., attention_mask=..., labels=...)`
            positions = torch.arange(tokens.shape[1]).expand_as(tokens)
            mask = torch.ones_like(tokens)
            if args.run == "preset-padded":
                mask[:: args.micro_batch, -min(64, tokens.shape[1] // 2) :] = 0
            labels = tokens.masked_fill(mask == 0, -100)  # shifted by the preset
            inputs = (tokens, *hf.plain_inputs(mask, positions), labels)
            target, reduction = labels, hf.counted_tokens
        else:
            inputs, target = (tokens, labels), labels
            reduction = lambda t: (t != -100).sum()  # noqa: E731
        start = time.perf_counter()
        engine.train_batch(inputs, target, lambda out, _: out, reduction=reduction)
        elapsed = time.perf_counter() - start
        engine.store.clear_grads()
        return elapsed

    try:
        for i in range(args.warmup):
            step(i)
        times = [step(args.warmup + i) for i in range(args.steps)]
    finally:
        engine.close()
    peak = max_memory_allocated() / 2**30 if cuda else 0.0
    return {
        "fwd_bwd_s": times,
        "tokens_per_s": args.seqs * args.seq_len * len(times) / sum(times),
        "parameters": params,
        "peak_gpu_gib": peak,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", choices=CONFIGS)
    p.add_argument("--configs", default="handwritten,preset")
    p.add_argument("--model", default="qwen3-1.7b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--seqs", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--fused-blocks", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", default=None)
    add_in_process_flag(p)
    args = p.parse_args()
    command = sys.argv[1:]
    results = run_or_drive(__file__, args, run_one, lambda done: write(args.out, command, __file__, done))
    if results is None:  # this process measured one configuration
        return
    by = {r["config"]: r for r in results if "error" not in r}
    for r in by.values():
        print(f"{r['config']:12} {r['tokens_per_s']:9.0f} tokens/s  {r['parameters'] / 1e9:.2f} B params")
    for name in ("preset", "preset-padded"):
        if name in by and "handwritten" in by:
            by[name]["ratio_to_handwritten"] = by[name]["tokens_per_s"] / by["handwritten"]["tokens_per_s"]
            print(f"{name} / hand-written: {by[name]['ratio_to_handwritten']:.3f}")
    if "preset" in by and "preset-padded" in by:
        by["preset-padded"]["ratio_to_preset"] = by["preset-padded"]["tokens_per_s"] / by["preset"]["tokens_per_s"]
        print(f"preset-padded / preset: {by['preset-padded']['ratio_to_preset']:.3f}")
    write(args.out, command, __file__, results)


if __name__ == "__main__":
    main()
