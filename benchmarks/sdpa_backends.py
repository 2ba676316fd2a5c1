"""Which SDPA backend a Hugging Face decoder's attention should run on (issue 24): forward + backward of
``F.scaled_dot_product_attention`` at the Qwen3-1.7B shape's micro-batches, per backend (flash, memory
efficient, cuDNN), with the key/value heads repeated (transformers' ``repeat_kv``) and with
``enable_gqa=True``. Times are CUDA events around 20 repetitions after 3 warm-ups; TFLOP/s counts the
causal half of ``4 * B * H * T^2 * D`` forward and 2.5 times that backward.

    python benchmarks/sdpa_backends.py --out benchmarks/results/sdpa-backends.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _driver import write

BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}


def measure(backend: str, batch: int, heads: int, kv_heads: int, seq: int, dim: int, gqa: bool) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(batch, kv_heads, seq, dim, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(batch, kv_heads, seq, dim, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    grad = torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16, generator=g)

    def once() -> torch.Tensor:
        if gqa:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            rep = heads // kv_heads
            kk, vv = (t.repeat_interleave(rep, dim=1) for t in (k, v))
            out = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
        out.backward(grad)
        return out

    try:
        with sdpa_kernel(BACKENDS[backend]):
            for _ in range(3):
                reference = once()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                once()
            end.record()
            torch.cuda.synchronize()
    except RuntimeError as e:
        return {"backend": backend, "gqa": gqa, "error": str(e).splitlines()[0][:200]}
    seconds = start.elapsed_time(end) / 1e3 / 20
    flops = 3.5 * 4 * batch * heads * seq * seq * dim / 2
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        rep = heads // kv_heads
        exact = F.scaled_dot_product_attention(
            q.float(), k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1), is_causal=True
        )
    error = ((reference.float() - exact).norm() / exact.norm()).item()
    return {"backend": backend, "gqa": gqa, "ms": seconds * 1e3, "tflops": flops / seconds / 1e12, "rel_error": error}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16, help="sequences per micro-batch")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    shape = (args.batch, args.heads, args.kv_heads, args.seq_len, args.head_dim)
    results = [measure(b, *shape, gqa) for gqa in (False, True) for b in BACKENDS]
    for r in results:
        print(r, flush=True)
    shape_meta = dict(zip(("batch", "heads", "kv_heads", "seq_len", "head_dim"), shape))
    write(args.out, sys.argv[1:], __file__, [{"shape": shape_meta, **r} for r in results])


if __name__ == "__main__":
    main()
