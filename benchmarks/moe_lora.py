"""LoRA fine-tuning of a large randomly initialised model on one GPU capped at 24 GB.

Shapes (``--shape``): Qwen3-30B-A3B (a mixture of experts: 48 layers, 128 experts, 8 per token),
GPT-OSS-20B (24 layers, 32 experts, 4 per token, attention sinks, alternating sliding windows) and
Mistral-7B (dense). The model is built in bf16 on the host (a 21 B model in fp32 would not leave the host
room for its pinned copy), wrapped with ``peft`` LoRA (the attention projections of a mixture of experts;
every linear layer of a dense model's blocks) and trained as a user would:
``Trainer(strategy="roundpipe", precision="bf16-mixed")`` with every default (``--micro-batch`` fixes
the micro-batch count) and the LightningModule of ``lightning_user.py`` (``self.model(**batch).loss``,
``AdamW(self.parameters())``). Prints tokens/s, peak GPU memory under the cap, and host memory: the frozen weights (kept
once, in bf16) and everything else. ``--shape debug`` (or ``debug-gpt-oss``, ``debug-mistral``)
``--device cpu`` is a smoke test.

    python benchmarks/moe_lora.py --out benchmarks/results/moe-lora.json
    python benchmarks/moe_lora.py --shape gpt-oss-20b --out ...
    python benchmarks/moe_lora.py --shape mistral-7b --out ...
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

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
    p.add_argument("--seqs", type=int, default=8, help="sequences per optimizer step (one batch)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=0, help="sequences per micro-batch (0: roundpipe chooses)")
    p.add_argument("--warmup", type=int, default=4, help="steps before the timed ones (roundpipe measures its layers)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import lightning as L
    from lightning_user import LM, Clock, ResidentMemory, Tokens, _Remember

    from lightning_roundpipe import RoundPipeStrategy

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_per_process_memory_fraction(
            args.gpu_gib * GiB / torch.cuda.get_device_properties(0).total_memory
        )
    resident = ResidentMemory()
    t0 = time.perf_counter()
    model = build(args.shape)
    built_s = time.perf_counter() - t0
    built_gib = resident.reading()
    print(f"model built in {built_s:.0f} s", flush=True)
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    vocab = SHAPES[args.shape][2]["vocab_size"]
    steps = args.warmup + args.steps
    clock = Clock(args.warmup, steps, resident)
    trainer = L.Trainer(
        strategy=RoundPipeStrategy(num_microbatches=args.seqs // args.micro_batch) if args.micro_batch else "roundpipe",
        accelerator="gpu" if cuda else "cpu", devices=1, precision="bf16-mixed", max_steps=steps, logger=False,
        callbacks=[clock, _Remember()], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    data = torch.utils.data.DataLoader(Tokens(vocab, args.seqs * steps, args.seq_len), batch_size=args.seqs)
    trainer.fit(LM(model), data)
    resident.stop()
    seconds = clock.stamps[-1] - clock.stamps[0]
    timed = len(clock.stamps) - 1
    engine = trainer.strategy._last_engine
    result = {
        "shape": args.shape,
        "parameters": params,
        "trainable": trainable,
        "seqs": args.seqs,
        "seq_len": args.seq_len,
        "timed_steps": timed,
        "tokens_per_s": args.seqs * args.seq_len * timed / seconds,
        "peak_gpu_gib": max_memory_allocated() / GiB if cuda else 0.0,
        "gpu_nvml_peak_gib": max(clock.nvml_gib, default=None),
        "gpu_cap_gib": args.gpu_gib if cuda else None,
        "host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB,
        "host_bytes_per_parameter": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / params,
        "host_gib_model_built": {"rss": round(built_gib[0], 2), "peak": round(built_gib[1], 2)},
        "host_gib_by_step": clock.host_gib,
        "frozen_host_bytes_per_frozen_param": engine["frozen_bytes"] / max(1, params - trainable),
        "losses": clock.losses,
        "build_s": built_s,
        **{k: engine[k] for k in ("plan", "microbatches", "pinned_gib", "transit_peak_gib", "kernels")},
    }
    print(json.dumps(result, indent=1))
    if args.out:
        meta = {"date": time.strftime("%Y-%m-%d"), "command": "python benchmarks/moe_lora.py " + " ".join(sys.argv[1:])}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "result": result}, indent=2))


if __name__ == "__main__":
    main()
