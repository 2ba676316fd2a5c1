"""Host memory a model needs under roundpipe, estimated before anything is allocated.

The engine keeps per parameter: the master (the parameter itself, already resident), a gradient in
the master's dtype (trainable only), a compute copy when the compute dtype differs (or, with the
asynchronous optimizer, always for trainable parameters), and the optimizer's states (AdamW: two
fp32 moments). Frozen parameters are stored once, in the compute dtype. Stage-boundary activations
depend on the batch; pass their size if known (``RoundPipeMonitor(layer_costs=...)`` records them).

``estimate_host_memory`` is public so a run can be sized before hardware is bought; the strategy
calls :func:`check_host_memory` before building the engine and refuses, with the table, a run that
would not fit in the memory available now instead of being killed by the OOM killer halfway.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from lightning_roundpipe.runtime.host_memory import available_host_memory, host_memory_limit

__all__ = [
    "HostMemoryEstimate",
    "available_host_memory",
    "check_host_memory",
    "estimate_host_memory",
    "host_memory_limit",
]

GiB = 2**30


@dataclass(frozen=True)
class HostMemoryEstimate:
    """Bytes by kind; ``resident`` is what the model already holds, ``new`` what roundpipe adds."""

    trainable_parameters: int
    frozen_parameters: int
    masters: int
    gradients: int
    compute_copies: int
    optimizer_states: int
    activations: int

    @property
    def resident(self) -> int:
        return self.masters

    @property
    def new(self) -> int:
        """Allocated by roundpipe on top of the model: gradients, compute copies, optimizer states,
        activations; minus what storing frozen parameters in the compute dtype frees."""
        return self.gradients + self.compute_copies + self.optimizer_states + self.activations

    @property
    def total(self) -> int:
        return self.resident + self.new

    def table(self) -> str:
        """A small table of the estimate, for messages and logs."""
        params = self.trainable_parameters + self.frozen_parameters
        rows = [
            ("master weights (frozen ones in the compute dtype)", self.masters),
            ("gradients", self.gradients),
            ("compute copies", self.compute_copies),
            ("optimizer states", self.optimizer_states),
            ("stage-boundary activations", self.activations),
            ("total", self.total),
        ]
        width = max(len(r[0]) for r in rows)
        lines = [f"{name:<{width}}  {n / GiB:9.2f} GiB" for name, n in rows]
        per = self.total / max(1, params)
        lines.append(f"{'bytes per parameter':<{width}}  {per:9.1f}   ({params / 1e9:.3f} B parameters)")
        return "\n".join(lines)


def estimate_host_memory(
    model: nn.Module | Iterable[nn.Parameter],
    compute_dtype: torch.dtype | None = torch.bfloat16,
    asynchronous: bool = True,
    optimizer_bytes_per_parameter: float | None = None,
    activation_bytes: int = 0,
    double_buffer: bool | str = False,
) -> HostMemoryEstimate:
    """Host bytes roundpipe needs for ``model`` (or its parameters).

    Args:
        compute_dtype: the dtype workers compute in (``torch.bfloat16`` for ``precision="bf16-mixed"``,
            ``None`` or the parameters' dtype for ``"32-true"``).
        asynchronous: ``RoundPipeStrategy(async_optimizer=...)``: trainable parameters then always get a
            separate compute copy.
        optimizer_bytes_per_parameter: optimizer state per trainable parameter (AdamW in fp32: 8;
            SGD with momentum: 4; plain SGD: 0); ``None``: AdamW's two moments in each parameter's dtype
            (8 for fp32 parameters, 4 for bf16 ones under ``precision="bf16-true"``).
        activation_bytes: stage-boundary activations of one batch, if known.
        double_buffer: ``RoundPipeStrategy(double_buffer=True)`` or ``"all"``: a second compute copy per
            trainable parameter (``"first"``, the first stage's only, is not counted).
    """
    params = list(model.parameters()) if isinstance(model, nn.Module) else list(model)
    seen: set[int] = set()
    trainable = frozen = masters = grads = compute = states = 0
    for p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        n, size = p.numel(), p.element_size()
        cast = compute_dtype is not None and p.dtype.is_floating_point and compute_dtype != p.dtype
        compute_size = torch.empty((), dtype=compute_dtype).element_size() if cast else size
        if not p.requires_grad:
            frozen += n
            masters += n * compute_size  # kept once, in the compute dtype
            continue
        trainable += n
        masters += n * size
        grads += n * size
        if cast or asynchronous:
            compute += n * compute_size * (2 if double_buffer in (True, "all") and asynchronous else 1)
        states += int(n * (2 * size if optimizer_bytes_per_parameter is None else optimizer_bytes_per_parameter))
    return HostMemoryEstimate(trainable, frozen, masters, grads, compute, states, activation_bytes)


def fits_host(estimate: HostMemoryEstimate, margin: float = 0.95) -> bool:
    """Whether a run's new host allocations fit ``margin`` of what the host has available."""
    return estimate.new <= margin * available_host_memory()


def check_host_memory(
    estimate: HostMemoryEstimate, margin: float = 0.95, leaner: dict[str, HostMemoryEstimate] | None = None
) -> None:
    """Refuse, with the estimate and the shortfall, a run whose new host allocations would not fit;
    ``leaner``: settings (as the user would write them) and their estimates, named when they would fit."""
    available = available_host_memory()
    if estimate.new <= margin * available:
        return
    fits = [
        f"{setting} would add {other.new / GiB:.2f} GiB, which fits."
        for setting, other in (leaner or {}).items()
        if other.new <= margin * available
    ]
    advice = (
        "Free host memory, train fewer parameters (LoRA), keep bf16 weights, gradients and optimizer states"
        " (precision='bf16-true': about 8 bytes per parameter with AdamW and async_optimizer=False), use an"
        " optimizer with smaller states, or a machine with more memory."
    )
    raise MemoryError(
        "roundpipe would need more host memory than is available: it adds"
        f" {estimate.new / GiB:.2f} GiB to the {estimate.resident / GiB:.2f} GiB the model holds, and"
        f" {available / GiB:.2f} GiB are available (short by {(estimate.new - margin * available) / GiB:.2f} GiB"
        f" with a {100 * (1 - margin):.0f}% margin).\n{estimate.table()}\n" + " ".join([*fits, advice])
    )
