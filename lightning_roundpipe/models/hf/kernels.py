"""Faster kernels for one model: liger-kernel's Triton RMSNorm, SwiGLU and rotary embedding bound onto
this model's own modules, and its fused linear cross-entropy in the output stage
(``RoundPipeStrategy(kernels=...)``).

Only the instance changes: a module's ``forward`` is replaced by an instance attribute (the workers'
replicas are deep copies and keep it), and the attention's rotary embedding by a copy of the attention's
``forward`` whose globals name Liger's function. The classes and transformers' module functions stay as
they are, so other models in the process run their own code; ``liger_kernel``'s
``apply_liger_kernel_to_*`` functions, which replace module globals, are never called. The kernels run
on CUDA tensors only: CPU workers keep the model's own code.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import types
from typing import Any

import torch
from torch import Tensor, nn

RMS_NORMS = frozenset(
    f"{family}RMSNorm" for family in ("Llama", "Qwen3", "Qwen3Moe", "Qwen2", "Qwen2Moe", "Mistral", "Mixtral")
)
"""Norms computing ``weight * (x * rsqrt(mean(x^2) + eps)).to(input dtype)`` with the statistics in fp32
(Liger's ``"llama"`` casting); Gemma's ``(1 + weight)`` norms are not among them."""

SWIGLU_MLPS = frozenset(f"{family}MLP" for family in ("Llama", "Qwen3", "Qwen2", "Mistral"))
"""MLPs computing ``down_proj(act(gate_proj(x)) * up_proj(x))``; fused only with a SiLU activation."""


@functools.cache
def liger_installed() -> bool:
    """Whether the parts of ``liger_kernel`` used here import (with the Triton they need)."""
    try:
        for name in ("liger_kernel.transformers.functional", "liger_kernel.transformers.rope"):
            importlib.import_module(name)
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss  # noqa: F401
    except Exception:  # not installed, no Triton, or a release without these names
        return False
    return True


def resolve(choice: str, cuda: bool) -> bool:
    """Whether to apply Liger's kernels for ``RoundPipeStrategy(kernels=choice)`` on CUDA workers (``cuda``)
    or CPU ones (``choice``: ``"auto"``, ``"liger"`` or ``"none"``); a clear error where ``"liger"`` cannot
    be honoured."""
    if choice == "none":
        return False
    if choice == "liger" and not cuda:
        raise ValueError(
            "RoundPipeStrategy(kernels='liger') runs Triton kernels on CUDA workers; these workers are CPU"
            " threads. Use kernels='auto' (Liger where it can run) or 'none'."
        )
    if choice == "liger" and not liger_installed():
        raise ImportError(
            "RoundPipeStrategy(kernels='liger') needs liger-kernel: `pip install liger-kernel` (or"
            " `pip install \"lightning-roundpipe[gpu]\"`), or use kernels='auto'."
        )
    return cuda and liger_installed()


def apply_liger(model: nn.Module, layers: list[nn.Module], blocks: bool = True) -> list[str]:
    """Bind Liger's kernels onto ``model``'s norms, MLPs and attention (see the module docstring) unless
    ``blocks`` is false (compiled blocks: Inductor fuses these itself, faster on an H200, and with Liger's
    kernels inside, compiled blocks failed on torch 2.11: docs/perf-notes.md), and have the output stage
    among ``layers`` use the fused linear cross-entropy; a module already carrying an instance ``forward``
    (patched by the user) is left as it is. Returns what was bound, as ``"RMSNorm x57"``-style counts."""
    counts = _bind_block_kernels(model) if blocks else {}
    for layer in layers:
        if getattr(layer, "fused_loss", None) is False:  # the output stage (stages.OutputStage)
            layer.fused_loss = True
            counts["fused linear cross-entropy"] = 1
    return [f"{kind} x{n}" for kind, n in sorted(counts.items())]


def _bind_block_kernels(model: nn.Module) -> dict[str, int]:
    from liger_kernel.transformers.functional import liger_rms_norm, liger_swiglu
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    counts: dict[str, int] = {}
    for module in model.modules():
        if "forward" in module.__dict__:
            continue
        name, forward = type(module).__name__, None
        if name in RMS_NORMS and isinstance(getattr(module, "weight", None), Tensor):
            kind, forward = "RMSNorm", types.MethodType(_rms_norm(liger_rms_norm), module)
        elif name in SWIGLU_MLPS and _silu(module):
            kind, forward = "SwiGLU", types.MethodType(_swiglu(liger_swiglu), module)
        elif name.endswith("Attention"):
            kind, forward = "rotary embedding", _with_global(module, "apply_rotary_pos_emb", liger_rotary_pos_emb)
        if forward is not None:
            module.forward = forward
            counts[kind] = counts.get(kind, 0) + 1
    return counts


FLCE_CHUNK_TOKENS = 2048
"""Tokens per chunk of Liger's fused linear cross-entropy. Its own choice, ``next_power_of_2(tokens /
ceil(vocab / hidden))``, is 128 tokens at 8,192 (Qwen3-1.7B shape): measured on an H200 3.3x slower
there than 2,048-token chunks (1.27x at 32,768 tokens), at the same peak memory."""


def chunk_mem_const(tokens: int, hidden: int, vocab: int, chunk_tokens: int = FLCE_CHUNK_TOKENS) -> int:
    """Liger's ``chunk_mem_const`` for chunks of about ``chunk_tokens``: it cuts ``tokens`` into
    ``ceil(vocab / (const * hidden))`` chunks (each rounded up to a power of two)."""
    return max(1, vocab * chunk_tokens // (hidden * max(tokens, 1)))


def fused_linear_cross_entropy(
    hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int, softcap: float | None = None
) -> Tensor:
    """``F.cross_entropy(hidden @ weight.T, labels)`` averaged over the counted tokens, by Liger's fused
    kernel: logits in chunks of about :data:`FLCE_CHUNK_TOKENS`, the loss's gradients computed in the
    forward (as the chunked loss does), the head's gradient summed in fp32. The count divides on the
    device: no host sync."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    flat_hidden, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    const = chunk_mem_const(flat_hidden.shape[0], flat_hidden.shape[1], weight.shape[0])
    total = liger_fused_linear_cross_entropy(
        flat_hidden, weight, flat_labels, ignore_index=ignore_index, reduction="sum", softcap=softcap,
        accum_dtype=torch.float32, chunk_mem_const=const,
    )  # fmt: skip
    return total / (flat_labels != ignore_index).sum().clamp_min(1)


def remove(model: nn.Module) -> None:
    """Take the bound kernels off again (the classes' own ``forward`` shows through)."""
    for module in model.modules():
        if getattr(module.__dict__.get("forward"), "__roundpipe_kernel__", False):
            del module.forward


def _rms_norm(kernel: Any) -> Any:
    def forward(self: nn.Module, hidden_states: Tensor) -> Tensor:
        if not hidden_states.is_cuda:
            return type(self).forward(self, hidden_states)
        eps = getattr(self, "variance_epsilon", None) or getattr(self, "eps", 1e-6)
        return kernel(hidden_states, self.weight, eps, offset=0.0, casting_mode="llama", in_place=True)

    forward.__roundpipe_kernel__ = True  # type: ignore[attr-defined]
    return forward


def _swiglu(kernel: Any) -> Any:
    def forward(self: nn.Module, x: Tensor) -> Tensor:
        if not x.is_cuda:
            return type(self).forward(self, x)
        return self.down_proj(kernel(self.gate_proj(x), self.up_proj(x)))

    forward.__roundpipe_kernel__ = True  # type: ignore[attr-defined]
    return forward


def _silu(mlp: nn.Module) -> bool:
    act = getattr(getattr(mlp, "config", None), "hidden_act", None)
    return act in ("silu", "swish") and all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj"))


def _with_global(module: nn.Module, name: str, value: Any) -> Any:
    """``module``'s class ``forward`` as a method of ``module`` whose global ``name`` is ``value``, or
    ``None`` when the forward does not look ``name`` up (nothing to replace). Decorators around the
    forward (transformers' keyword renames) are left out: the calls come from the same release's blocks."""
    function = inspect.unwrap(type(module).forward)
    if name not in function.__code__.co_names or function.__globals__.get(name, value) is value:
        return None  # not looked up, or already the kernel (the user patched the module globally)
    copy = types.FunctionType(
        function.__code__, {**function.__globals__, name: _on_cuda(value, function.__globals__[name])},
        function.__name__, function.__defaults__, function.__closure__,
    )  # fmt: skip
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__roundpipe_kernel__ = True  # type: ignore[attr-defined]
    return types.MethodType(copy, module)


def _on_cuda(kernel: Any, fallback: Any) -> Any:
    def call(q: Tensor, k: Tensor, *args: Any, **kwargs: Any) -> Any:
        return (kernel if q.is_cuda else fallback)(q, k, *args, **kwargs)

    return call
