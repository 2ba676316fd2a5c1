"""LoRA fine-tuning of a large randomly initialised model on one GPU capped at 24 GB.

Shapes (``--shape``): Qwen3-30B-A3B (a mixture of experts: 48 layers, 128 experts, 8 per token),
GPT-OSS-20B (24 layers, 32 experts, 4 per token, attention sinks, alternating sliding windows) and
Mistral-7B (dense). The model is built in bf16 on the host (a 21 B model in fp32 would not leave the host
room for its pinned copy), wrapped with ``peft`` LoRA (the attention projections of a mixture of experts;
every linear layer of a dense model's blocks) and trained through its preset with the asynchronous host
optimizer. Prints tokens/s, peak GPU memory under the cap, and host memory: the frozen weights (kept
once, in bf16) and everything else. ``--shape debug`` (or ``debug-gpt-oss``, ``debug-mistral``)
``--device cpu`` is a smoke test.

    python benchmarks/moe_lora.py --out benchmarks/results/moe-lora.json
    python benchmarks/moe_lora.py --shape gpt-oss-20b --out ...
    python benchmarks/moe_lora.py --shape mistral-7b --out ...
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from qwen3_shape import init_hf

from lightning_roundpipe.runtime.device import max_memory_allocated

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
SHAPES = {
    # name: (config class, model class, config, LoRA targets)
    "qwen3-30b-a3b": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144, vocab_size=151936,
        decoder_sparse_step=1, attn_implementation="sdpa",
    ), ATTENTION),
    "gpt-oss-20b": ("GptOssConfig", "GptOssForCausalLM", dict(
        hidden_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        num_local_experts=32, num_experts_per_tok=4, intermediate_size=2880, vocab_size=201088, sliding_window=128,
    ), ATTENTION),
    "mistral-7b": ("MistralConfig", "MistralForCausalLM", dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
        vocab_size=32768, sliding_window=None, attn_implementation="sdpa",
    ), "all-linear"),
    "debug": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=128, vocab_size=211,
        decoder_sparse_step=1, attn_implementation="sdpa",
    ), ATTENTION),
    "debug-gpt-oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, vocab_size=211, sliding_window=8,
    ), ATTENTION),
    "debug-mistral": ("MistralConfig", "MistralForCausalLM", dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=211, sliding_window=None, attn_implementation="sdpa",
    ), "all-linear"),
}  # fmt: skip
GiB = 2**30


def build(shape: str) -> torch.nn.Module:
    import peft
    import transformers

    config_class, model_class, fields, targets = SHAPES[shape]
    config = getattr(transformers, config_class)(**fields, tie_word_embeddings=False)
    # built in bf16 from the start: an fp32 model of 30 B parameters (122 GB) would not fit the host
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = getattr(transformers, model_class)(config)
    finally:
        torch.set_default_dtype(default)
    model = model.to_empty(device="cpu")
    init_hf(model, config, tile=1 << 24)  # values do not matter here; drawing 30 B normals takes minutes
    lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules=targets, lora_dropout=0.0)
    model = peft.get_peft_model(model, lora)
    for p in model.parameters():  # adapters keep fp32 masters; the frozen base stays bf16
        if p.requires_grad:
            p.data = p.data.float()
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--gpu-gib", type=float, default=24.0)
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    from lightning_roundpipe.engine import PipelineEngine
    from lightning_roundpipe.models import hf
    from lightning_roundpipe.runtime import WorkerDevice
    from lightning_roundpipe.runtime.device import CudaWorkerDevice
    from lightning_roundpipe.runtime.optimizer_worker import UpdateSpec

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
        torch.cuda.set_per_process_memory_fraction(
            args.gpu_gib * GiB / torch.cuda.get_device_properties(0).total_memory
        )
    rss0 = psutil.Process().memory_info().rss
    t0 = time.perf_counter()
    model = build(args.shape)
    built_s = time.perf_counter() - t0
    print(f"model built in {built_s:.0f} s", flush=True)
    params = sum(p.numel() for p in model.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    device = CudaWorkerDevice("cuda:0", 0) if cuda else WorkerDevice("cpu", 0)
    engine = PipelineEngine(
        hf.build_layers(model),
        [device],
        microbatches_per_round=args.seqs // args.micro_batch,
        compute_dtype=torch.bfloat16,
        autocast_dtype=torch.bfloat16,
        asynchronous=True,
    )
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    g = torch.Generator().manual_seed(1)
    vocab = SHAPES[args.shape][2]["vocab_size"]
    times = []
    try:
        for step in range(args.steps + 1):
            ids = torch.randint(0, vocab, (args.seqs, args.seq_len), generator=g)
            start = time.perf_counter()
            inputs = (ids, None, torch.arange(args.seq_len).expand_as(ids), ids)
            engine.train_batch(inputs, ids, lambda out, _: out, reduction=hf.counted_tokens)
            engine.submit_step(UpdateSpec.capture(opt))
            print(f"step {step}: {time.perf_counter() - start:.2f} s", flush=True)
            if step:
                times.append(time.perf_counter() - start)
        engine.flush()
    finally:
        engine.close()
    frozen = sum(g.data.numel() * g.data.element_size() for g in engine.store.groups if g.kind == "frozen")
    result = {
        "shape": args.shape,
        "parameters": params,
        "trainable": sum(p.numel() for p in trainable),
        "step_s": times,
        "tokens_per_s": args.seqs * args.seq_len * len(times) / sum(times),
        "peak_gpu_gib": max_memory_allocated() / GiB if cuda else 0.0,
        "gpu_cap_gib": args.gpu_gib if cuda else None,
        "host_rss_gib": (psutil.Process().memory_info().rss - rss0) / GiB,
        "frozen_host_bytes_per_frozen_param": frozen / (params - sum(p.numel() for p in trainable)),
        "build_s": built_s,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        meta = {"date": time.strftime("%Y-%m-%d"), "command": "python benchmarks/moe_lora.py " + " ".join(sys.argv[1:])}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "result": result}, indent=2))


if __name__ == "__main__":
    main()
