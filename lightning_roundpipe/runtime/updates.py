"""What one update is: the settings the strategy captures when it submits a step (:class:`UpdateSpec`), the
batches of the step (:class:`StepWindow`) and the job the optimizer thread runs (:class:`UpdateJob`), with the
gates that order it (the edges of :mod:`~lightning_roundpipe.runtime.optimizer_worker`)."""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_roundpipe.runtime.workers import Gate, PipelineAborted


@dataclass
class UpdateSpec:
    """What the strategy captures on the main thread when it submits a step."""

    optimizer: torch.optim.Optimizer
    hyperparameters: list[dict[str, Any]]
    """Per parameter group, everything but ``params`` (LR and friends as of submission)."""
    clip_value: float | None = None
    clip_algorithm: str = "norm"
    measure_norm: bool = False
    """Compute the gradients' global 2-norm (before clipping) even when not clipping by norm."""
    scaler: torch.amp.GradScaler | None = None
    """``precision="16-mixed"``: the scaler whose scale and growth tracker this update advances."""
    loss_scale: float = 1.0
    """The loss scale the step's batches multiplied their loss by (what its gradients are divided by)."""

    @classmethod
    def capture(
        cls,
        optimizer: Any,
        clip_value: float | None = None,
        clip_algorithm: str = "norm",
        measure_norm: bool = False,
        scaler: torch.amp.GradScaler | None = None,
        loss_scale: float = 1.0,
    ) -> UpdateSpec:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # unwrap Lightning's LightningOptimizer
        hyper = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        return cls(
            optimizer, hyper, clip_value or None, str(clip_algorithm or "norm"), measure_norm, scaler, loss_scale
        )


class StepWindow:
    """The flights of one optimizer step, known completely once the window is closed."""

    def __init__(self, abort: threading.Event) -> None:
        self.flights: list[Any] = []
        self.closed = Gate(abort)


@dataclass
class UpdateJob:
    step: int
    spec: UpdateSpec | None
    """``None``: no math, only the cast (a resumed run's pending cast of the update saved with it)."""
    groups: tuple[int, ...]
    """Trainable groups in update order (deep layers first: the order the next backward needs them)."""
    grads_complete: dict[int, Gate]
    consumed: dict[int, Gate]
    cast_done: dict[int, Gate]
    next_window: StepWindow
    cast: bool = True
    """``False``: the engine casts this update itself at the next step's barrier (the blocking variant)."""
    window: StepWindow | None = None
    """This step's batches (``None``: none, e.g. a resumed run's pending cast): with double buffering,
    the last ones to read the compute copy the cast overwrites."""
    one_pass: bool = False
    """Update and cast each double-buffered group in one pass (:mod:`~lightning_roundpipe.runtime.one_pass`): every
    trainable group has its spare, and the kernel was compiled and checked when the update was submitted."""
    math_done: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)

    def wait_gradient(self, g: int) -> None:
        """Wait until group ``g``'s gradient of the step is complete. After an abort (a failure in the next
        batch) go on where every gradient of the step had landed: the update then finishes, and the weights
        after a failure are whole steps, not some layers one update behind the rest."""
        try:
            self.grads_complete[g].wait()
        except PipelineAborted:
            if not all(gate.happened() for gate in self.grads_complete.values()):
                raise
