"""Precision plugin for roundpipe: fp32 master weights on the host, a compute dtype on the workers.

- ``"32-true"``: fp32 everywhere.
- ``"bf16-mixed"``: parameters are uploaded in bf16 and workers compute under bf16 autocast;
  gradients come back in bf16 and are summed into fp32 on the host.
- ``"16-mixed"``: the same in fp16, with dynamic loss scaling by torch's ``GradScaler`` on the host
  gradients: a step with non-finite gradients is skipped and the scale lowered. With the asynchronous
  optimizer the optimizer thread unscales, checks and decides (the scaler's own kernels), one step
  stale like the gradients: the batches of step ``t`` all use the scale after update ``t - 2``'s
  decision (update ``t - 1`` runs while they do), and no device sync is added.
- ``"bf16-true"``: what plain Lightning's means, on the host: the module's parameters are bf16 (built so
  under ``configure_model``), the masters are the weights the workers compute with (no fp32 copy, no
  separate compute copy in the synchronous mode), gradients and the optimizer's states are bf16, float
  inputs are cast to bf16, and the workers run without autocast: about 8 host bytes per parameter
  with AdamW instead of 18. Unlike plain Lightning's, torch's default dtype is left alone during
  ``forward``: it is process-wide, and the workers run outside the step.

Backward already happened inside the pipeline when ``training_step`` returns, so ``backward`` here
only runs Lightning's hooks around a no-op. Workers enter autocast themselves (it is per thread);
the main thread's context covers whatever ``*_step`` computes on the host.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any, Literal

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from typing_extensions import override

from lightning_roundpipe._flavor import lightning_package

pl = lightning_package(globals())
_Precision = pl.plugins.precision.Precision
_MixedPrecision = pl.plugins.precision.MixedPrecision

_HalfPrecision = pl.plugins.precision.HalfPrecision

_PrecisionName = Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true"]
SUPPORTED: tuple[str, ...] = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
_DTYPES = {"32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "bf16-true": torch.bfloat16}


class RoundPipePrecision(_Precision):  # type: ignore[misc,valid-type]
    """Host fp32 masters; ``compute_dtype`` on the workers; loss scaling for ``"16-mixed"``."""

    def __init__(self, precision: _PrecisionName = "32-true", scaler: torch.amp.GradScaler | None = None) -> None:
        if precision not in SUPPORTED:
            raise ValueError(
                f"RoundPipePrecision(precision={precision!r}) is not supported; choose one of {SUPPORTED}."
            )
        if scaler is not None and precision != "16-mixed":
            raise ValueError(f"a GradScaler is only used with precision='16-mixed', not {precision!r}")
        self.precision = precision
        self.scaler = scaler if scaler is not None or precision != "16-mixed" else torch.amp.GradScaler("cpu")
        if self.scaler is not None:
            self.scaler.scale(torch.ones(()))  # creates the scale tensor, on the host where gradients live
        self._step_scale = (-1, self.scaler.get_scale() if self.scaler is not None else 1.0)

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """Parameter and autocast dtype on the workers; ``None`` means fp32 without autocast."""
        return _DTYPES[self.precision]

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The workers' autocast dtype: the compute dtype for the mixed precisions, none for ``"bf16-true"``
        (its weights and inputs are bf16 already, and plain ``bf16-true`` runs no autocast)."""
        return None if self.precision == "bf16-true" else self.compute_dtype

    @override
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.to(dtype=torch.bfloat16) if self.precision == "bf16-true" else module

    @override
    def convert_input(self, data: Any) -> Any:
        if self.precision != "bf16-true":
            return data
        return apply_to_collection(data, Tensor, lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t)

    @override
    def tensor_init_context(self) -> contextlib.AbstractContextManager[Any]:
        return _default_dtype(torch.bfloat16) if self.precision == "bf16-true" else contextlib.nullcontext()

    @override
    def module_init_context(self) -> contextlib.AbstractContextManager[Any]:
        return self.tensor_init_context()

    @property
    def loss_scale(self) -> float:
        """Factor the pipeline multiplies the loss by before backward (1 unless ``"16-mixed"``): the
        scaler's, or with the asynchronous optimizer the current step's (:meth:`step_scale`)."""
        if self._step_scale[0] >= 0:
            return self._step_scale[1]
        return self.scaler.get_scale() if self.scaler is not None else 1.0

    def step_scale(self, engine: Any) -> float:
        """The loss scale the current step's batches multiply by: the scaler's; with the asynchronous
        optimizer, the scale after update ``step - 2``'s decision (waiting for it, on the host only), the
        same for every batch of the step (the scale of the step before when that update decided none)."""
        optimizer = engine.crew.optimizer
        if self.scaler is None or optimizer is None:
            return self.loss_scale
        step = engine.steps.step
        if self._step_scale[0] != step:
            decided = optimizer.scale_after(step - 2) if step >= 2 else None
            self._step_scale = (step, self._step_scale[1] if decided is None else decided)
        return self._step_scale[1]

    def check_supported(self, asynchronous: bool, num_nodes: int) -> None:
        """Refuse what loss scaling cannot do yet: several nodes."""
        if self.precision == "16-mixed" and num_nodes > 1:
            raise ValueError(
                "precision='16-mixed' across nodes is not supported yet: every node would have to agree on"
                " skipping a step. Use precision='bf16-mixed' (no loss scaling needed) with num_nodes > 1."
            )

    @override
    def backward(self, tensor: Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        """Nothing to do: the pipeline ran backward while ``training_step`` was running."""

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        self.scaler.unscale_(optimizer)  # clipping and hooks below see true gradients
        self._after_closure(model, optimizer)
        if closure_result is None:
            return None
        step_output = self.scaler.step(optimizer, **kwargs)  # skipped when a gradient is inf or nan
        self.scaler.update()
        return step_output

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.autocast_dtype is None:
            yield
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16 if self.precision == "bf16-mixed" else torch.float16):
                yield

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)
            self.scaler.scale(torch.ones(()))


def convert(plugin: Any) -> RoundPipePrecision | None:
    """Turn the plugin Lightning picked for ``Trainer(precision=...)`` into a :class:`RoundPipePrecision`."""
    if plugin is None or isinstance(plugin, RoundPipePrecision):
        return plugin
    if type(plugin) is _Precision:
        return RoundPipePrecision("32-true")
    if isinstance(plugin, _MixedPrecision) and plugin.precision in ("bf16-mixed", "16-mixed"):
        return RoundPipePrecision(plugin.precision)
    if isinstance(plugin, _HalfPrecision) and plugin.precision == "bf16-true":
        return RoundPipePrecision("bf16-true")
    name = getattr(plugin, "precision", type(plugin).__name__)
    raise ValueError(
        f"`Trainer(strategy='roundpipe', precision={name!r})` is not supported. roundpipe keeps master weights"
        f" on the host and computes in a chosen dtype on the workers: use precision='32-true', 'bf16-mixed',"
        f" '16-mixed' or 'bf16-true'."
    )


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Generator[None, None, None]:
    """Tensors created without a dtype get ``dtype`` (``configure_model`` builds a bf16 model directly)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)
