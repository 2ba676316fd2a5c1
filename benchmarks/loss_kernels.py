"""The LM head and cross-entropy at the Qwen3-1.7B shape, forward + backward, per implementation and
micro-batch size (issue 24): Liger's fused linear cross-entropy with its own chunking (chunks of
``next_power_of_2(tokens / ceil(vocab / hidden))`` tokens: 128 at 8,192 tokens, 512 at 32,768), the same
kernel with ``chunk_mem_const`` raised so chunks are about 2,048 tokens, and roundpipe's chunked loss
(2,048-token chunks). Times are CUDA events around 10 repetitions after 2 warm-ups.

    python benchmarks/loss_kernels.py --out benchmarks/results/loss-kernels.json
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from lightning_roundpipe.models import chunked_linear_cross_entropy

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _driver import write


def liger(chunk_tokens: int | None):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    def loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        tokens, width = hidden.shape
        const = 1
        if chunk_tokens is not None:  # chunks of tokens / ceil(vocab / (const * hidden)), rounded up to 2^k
            const = max(1, math.floor(weight.shape[0] * chunk_tokens / (width * tokens)))
        return liger_fused_linear_cross_entropy(
            hidden, weight, labels, reduction="mean", accum_dtype=torch.float32, chunk_mem_const=const
        )

    return loss


def measure(name: str, fn, tokens: int, hidden: int, vocab: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(tokens, hidden, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    y = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)

    def once() -> torch.Tensor:
        loss = fn(h, w, y)
        loss.backward()
        return loss

    try:
        for _ in range(2):
            once()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            loss = once()
        end.record()
        torch.cuda.synchronize()
    except Exception as e:  # a missing kernel is a result here
        return {"loss": name, "tokens": tokens, "error": str(e).splitlines()[0][:200]}
    seconds = start.elapsed_time(end) / 1e3 / 10
    flops = 3 * 2 * tokens * hidden * vocab
    return {
        "loss": name, "tokens": tokens, "ms": seconds * 1e3, "tflops": flops / seconds / 1e12,
        "extra_peak_gib": (torch.cuda.max_memory_allocated() - base) / 2**30, "value": float(loss),
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="8192,32768", help="tokens per micro-batch, comma-separated")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    losses = {
        "liger": liger(None),
        "liger-2048": liger(2048),
        "chunked-2048": lambda h, w, y: chunked_linear_cross_entropy(h, w, y, chunk_size=2048),
    }
    results = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        for name, fn in losses.items():
            results.append(measure(name, fn, tokens, args.hidden, args.vocab))
            print(results[-1], flush=True)
    write(args.out, sys.argv[1:], __file__, results)


if __name__ == "__main__":
    main()
