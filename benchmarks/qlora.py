"""QLoRA through ``Trainer`` (issue 40): a Llama-shaped model whose base weights are 4-bit NF4 (double quantization,
bf16 compute: what ``BitsAndBytesConfig(load_in_4bit=True, ...)`` makes), random and quantized in place (no
downloads), with peft's LoRA (r=16) on every linear layer of the blocks, trained by the module a user writes
(``self.model(**batch).loss``, ``AdamW(self.parameters())``), bf16-mixed, one process per configuration:

- ``roundpipe``: ``Trainer(strategy="roundpipe")`` with every default (``--gpu-gib`` caps the card);
- ``plain``: plain Lightning QLoRA as its recipes have it, the model on the card, gradient checkpointing;
- ``roundpipe-bf16``: roundpipe's defaults on the same shape with bf16 base weights (LoRA without quantization),
  for the host bytes and speed that 4-bit weights save.

The 70B shape at 24 GiB against plain on the full card (about 9 minutes on one H200)::

    python benchmarks/qlora.py --shape llama-70b --configs roundpipe --gpu-gib 24 --out r.json
    python benchmarks/qlora.py --shape llama-70b --configs plain --out p.json
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from _driver import add_in_process_flag, run_or_drive, write
from lightning_user import LM, Clock, GiB, ResidentMemory, Tokens, _Remember, allocator_stats
from torch import nn
from torch.utils.data import DataLoader


@dataclass(frozen=True)
class Llama:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int


SHAPES = {
    "llama-70b": Llama(8192, 80, 64, 8, 28672, 128256),  # Llama-3.1-70B
    "llama-8b": Llama(4096, 32, 32, 8, 14336, 128256),  # Llama-3.1-8B
    "debug": Llama(64, 2, 4, 2, 128, 256),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(shape: Llama, four_bit: bool, seed: int = 0) -> nn.Module:
    """The model on the host: each block's linear weights drawn (N(0, 0.02)) on the GPU where there is one and
    quantized there to NF4 (``four_bit``) or kept in bf16; embeddings, norms and head in bf16."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, tie_word_embeddings=False,
        max_position_embeddings=1 << 17, rope_theta=500_000.0, attn_implementation="sdpa",
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model = model.to_empty(device="cpu")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=device).manual_seed(seed)
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Embedding) or name == "lm_head":
            module.weight.data.normal_(0.0, 0.02)
        elif "norm" in type(module).__name__.lower():
            module.weight.data.fill_(1.0)
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child_name in TARGETS:
                weight = torch.randn(child.out_features, child.in_features, generator=g, device=device)
                weight = weight.mul_(0.02).to(torch.bfloat16)
                setattr(module, child_name, quantize(weight) if four_bit else _linear(weight))
    for module in model.modules():  # the rotary tables, from a freshly built rotary module
        if hasattr(module, "inv_freq"):
            fresh = type(module)(config=config)
            for name, buffer in fresh.named_buffers():
                getattr(module, name).copy_(buffer)
    return model


def _linear(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    layer.weight = nn.Parameter(weight.cpu(), requires_grad=False)
    return layer


def quantize(weight: torch.Tensor) -> nn.Module:
    """A bitsandbytes ``Linear4bit`` holding ``weight`` as NF4 with double quantization, on the host (as
    transformers' loading with ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
    bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)`` leaves it with ``device_map="cpu"``)."""
    import bitsandbytes as bnb
    from bitsandbytes.functional import quantize_4bit

    packed, state = quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
    state.to("cpu")
    layer = bnb.nn.Linear4bit(
        weight.shape[1], weight.shape[0], bias=False, compute_dtype=torch.bfloat16, quant_type="nf4", device="meta"
    )
    layer.weight = bnb.nn.Params4bit(
        packed.cpu(), requires_grad=False, quant_state=state, blocksize=64, compress_statistics=True,
        quant_type="nf4", module=layer, bnb_quantized=True,
    )  # fmt: skip
    return layer


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    import peft

    shape = SHAPES[args.shape]
    cuda = torch.cuda.is_available()
    plain = args.run == "plain"
    if cuda and args.gpu_gib and not plain:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(args.gpu_gib * GiB / total, 0)
    resident = ResidentMemory()
    started = time.perf_counter()
    model = build(shape, four_bit=args.run != "roundpipe-bf16")
    if cuda:
        torch.cuda.empty_cache()  # the drawing's blocks: the run starts from an empty card
    built = {"seconds": time.perf_counter() - started, "rss_gib": resident.reading()[0]}
    L.seed_everything(0, verbose=False)
    lora = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS, lora_dropout=0.0)
    model = peft.get_peft_model(model, lora)
    if plain:
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    module = LM(model)
    steps = args.warmup + args.steps
    data = DataLoader(Tokens(shape.vocab, args.seqs * steps, args.seq_len), batch_size=args.micro_batch if plain
                      else args.seqs)  # fmt: skip
    clock = Clock(args.warmup, steps, resident)
    trainer = L.Trainer(
        strategy="auto" if plain else "roundpipe", accelerator="gpu" if cuda else "cpu", devices=1,
        precision="bf16-mixed", max_steps=steps, accumulate_grad_batches=args.seqs // args.micro_batch if plain else 1,
        logger=False, callbacks=[clock, _Remember()], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, data)
    seconds = clock.stamps[-1] - clock.stamps[0]
    timed = len(clock.stamps) - 1
    tokens_per_s = sum(clock.tokens[args.warmup : args.warmup + timed]) / seconds
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB
    result = {
        "tokens_per_s": tokens_per_s,
        "timed_steps": timed,
        "timed_seconds": seconds,
        "host_peak_rss_gib": peak_rss,
        "gpu_nvml_peak_gib": max(clock.nvml_gib, default=None),
        "gpu_torch_peak_gib": torch.cuda.max_memory_allocated(0) / GiB if cuda else None,
        "gpu_allocator": allocator_stats() if cuda else None,
        "gpu_gib_cap": None if plain else args.gpu_gib or None,
        "built": built,
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "losses": clock.losses,
        "host_gib_by_step": clock.host_gib,
        "seqs": args.seqs,
        "seq_len": args.seq_len,
    }
    resident.stop()
    result.update(getattr(trainer.strategy, "_last_engine", None) or {})
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-70b", choices=sorted(SHAPES))
    parser.add_argument("--configs", default="roundpipe,plain")
    parser.add_argument("--run", default="", help=argparse.SUPPRESS)
    parser.add_argument("--gpu-gib", type=float, default=24.0, help="roundpipe's cap on the card (plain: full card)")
    parser.add_argument("--seqs", type=int, default=8, help="sequences per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=2, help="plain: sequences per accumulated batch")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--config-timeout", type=float, default=0)
    parser.add_argument("--out", default="")
    add_in_process_flag(parser)
    args = parser.parse_args(argv)
    results = run_or_drive(__file__, args, run_one, on_result=lambda r: write(args.out, sys.argv[1:], __file__, r))
    if results is None:
        return
    for r in results:
        if "error" in r:
            print(f"{r['config']:16s} failed: {r['error'][-300:]}")
            continue
        print(
            f"{r['config']:16s} {r['tokens_per_s']:9.0f} tok/s  NVML {r['gpu_nvml_peak_gib'] or 0:6.1f} GiB"
            f"  torch {r['gpu_torch_peak_gib'] or 0:6.1f} GiB  host {r['host_peak_rss_gib']:6.1f} GiB"
        )


if __name__ == "__main__":
    main()
