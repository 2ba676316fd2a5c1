"""LM head and cross-entropy in chunks, so full-vocabulary logits are never held for a whole micro-batch.

The algorithm, for hidden states ``h`` (T x H), head weight ``W`` (V x H) and labels ``y`` (T):

1. Count the tokens that are not ``ignore_index``: ``n``.
2. For each chunk of ``chunk_size`` tokens: compute the chunk's logits ``h_c W^T`` in fp32, their
   log-sum-exp, and the loss ``sum(lse - logit[y])`` over counted tokens.
3. In the same pass, the chunk's gradient of the *mean* loss w.r.t. its logits is
   ``(softmax - onehot(y)) / n`` (zero on ignored rows). Multiply it out at once: ``dh_c = dlogits W``
   and ``dW += dlogits^T h_c``. Then drop the chunk's logits.
4. Backward only scales the stored ``dh`` and ``dW`` by the incoming gradient.

With a soft cap ``c`` (Gemma) the logits are ``c * tanh(z / c)`` of the head's output ``z``; the gradient
w.r.t. ``z`` is the logits' times ``1 - tanh(z / c)^2`` (one more fp32 chunk while it is alive).

Peak extra memory is ``dW`` in fp32 plus one chunk of fp32 logits (reused for their gradient) and
its low-precision copy, instead of ``T x V`` logits and their gradient: it does not grow with ``T``.
The matmuls run in the compute dtype (bf16 under autocast) with fp32 accumulation. On CUDA they
write fp32 directly (``out_dtype``), so neither the logits nor ``dW``'s per-chunk term exist twice.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

_FP32_OUT = {"mm": True, "addmm": True}  # turned off where this build of torch lacks the kernels


def _low_precision_cuda(t: Tensor) -> bool:
    return t.is_cuda and t.dtype in (torch.bfloat16, torch.float16)


def _logits_fp32(h: Tensor, w: Tensor) -> Tensor:
    if _FP32_OUT["mm"] and _low_precision_cuda(h):
        try:
            return torch.mm(h, w.T, out_dtype=torch.float32)
        except (RuntimeError, TypeError, NotImplementedError):
            _FP32_OUT["mm"] = False
    return (h @ w.T).float()


def _accumulate_fp32(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` with ``acc`` fp32 and ``a``, ``b`` possibly low precision."""
    if _FP32_OUT["addmm"] and _low_precision_cuda(a):
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        except (RuntimeError, TypeError, NotImplementedError):
            _FP32_OUT["addmm"] = False
    acc.add_(a @ b)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        ignore_index: int,
        chunk_size: int,
        softcap: float | None = None,
    ) -> Tensor:
        compute_dtype = hidden.dtype
        w = weight.to(compute_dtype)
        counted = labels != ignore_index
        n = counted.sum()
        denom = n.clamp_min(1).to(torch.float32)
        # under no_grad (forward stages, evaluation) nothing needs a gradient: the loss alone
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            h = hidden[start : start + chunk_size]
            y = labels[start : start + chunk_size]
            keep = counted[start : start + chunk_size]
            logits = _logits_fp32(h, w)
            capped = None
            if softcap is not None:
                logits.div_(softcap).tanh_()
                capped = logits.square().neg_().add_(1.0)  # d logits / d z = 1 - tanh^2
                logits.mul_(softcap)
            safe_y = torch.where(keep, y, torch.zeros_like(y))
            picked = logits.gather(1, safe_y[:, None]).squeeze(1)
            # log-sum-exp in the logits' own memory (torch.logsumexp would allocate a second chunk)
            top = logits.amax(dim=-1)
            exps = logits.sub_(top[:, None]).exp_()
            sums = exps.sum(dim=-1)
            lse = top + sums.log()
            total += torch.where(keep, lse - picked, torch.zeros_like(lse)).sum()
            if grad_hidden is None and grad_weight is None:
                del logits, exps
                continue
            probs = exps.div_(sums[:, None])  # softmax
            probs.scatter_add_(1, safe_y[:, None], -torch.ones_like(picked)[:, None])
            probs.mul_((keep.float() / denom)[:, None])
            if capped is not None:
                probs.mul_(capped)
            g = probs.to(compute_dtype)
            del logits, exps, probs, capped  # every fp32 chunk's name: freed before the next one exists
            if grad_hidden is not None:
                grad_hidden[start : start + chunk_size] = g @ w
            if grad_weight is not None:
                _accumulate_fp32(grad_weight, g.T, h)  # matmul in the compute dtype, summed in fp32
            del g
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total / denom

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        grad_hidden, grad_weight = ctx.saved_tensors
        dh = grad_hidden * grad_output.to(grad_hidden.dtype) if grad_hidden is not None else None
        dw = None
        if grad_weight is not None:  # scaled straight into the weight's dtype: no fp32 temporary
            dw = torch.empty(grad_weight.shape, dtype=ctx.weight_dtype, device=grad_weight.device)
            torch.mul(grad_weight, grad_output, out=dw)
        return dh, dw, None, None, None, None


def chunked_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    ignore_index: int = -100,
    chunk_size: int = 2048,
    softcap: float | None = None,
) -> Tensor:
    """``F.cross_entropy(hidden @ weight.T, labels, ignore_index=...)`` (mean over counted tokens),
    computed ``chunk_size`` tokens at a time; with ``softcap``, of ``softcap * tanh(logits / softcap)``.
    ``hidden`` is ``(..., H)``, ``labels`` matches its leading dimensions; the result is 0 when no token
    is counted."""
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden states {tuple(hidden.shape)} do not match labels {tuple(labels.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return _ChunkedLinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), ignore_index, chunk_size, softcap
    )
