"""Precision plugin for roundpipe: fp32 master weights on the host, the compute dtype on the workers.

Backward already happened inside the pipeline when ``training_step`` returns, so ``backward`` here
only runs Lightning's hooks around a no-op. Workers enter autocast themselves (it is per thread);
the main thread's context covers whatever ``*_step`` computes on the host.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any, Literal

import torch
from torch import Tensor
from typing_extensions import override

from lightning_roundpipe._flavor import lightning_package

pl = lightning_package(globals())
_Precision = pl.plugins.precision.Precision
_MixedPrecision = pl.plugins.precision.MixedPrecision

_PrecisionName = Literal["32-true", "bf16-mixed"]
SUPPORTED: tuple[str, ...] = ("32-true", "bf16-mixed")


class RoundPipePrecision(_Precision):  # type: ignore[misc,valid-type]
    """``"32-true"``: fp32 compute. ``"bf16-mixed"``: workers compute under bf16 autocast."""

    def __init__(self, precision: _PrecisionName = "32-true") -> None:
        if precision not in SUPPORTED:
            raise ValueError(
                f"RoundPipePrecision(precision={precision!r}) is not supported; choose one of {SUPPORTED}."
            )
        self.precision = precision

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """Autocast dtype for the workers; ``None`` means plain fp32."""
        return torch.bfloat16 if self.precision == "bf16-mixed" else None

    @override
    def backward(self, tensor: Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        """Nothing to do: the pipeline ran backward while ``training_step`` was running."""

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.compute_dtype is None:
            yield
        else:
            with torch.autocast("cpu", dtype=self.compute_dtype):
                yield


def convert(plugin: Any) -> RoundPipePrecision | None:
    """Turn the plugin Lightning picked for ``Trainer(precision=...)`` into a :class:`RoundPipePrecision`."""
    if plugin is None or isinstance(plugin, RoundPipePrecision):
        return plugin
    if type(plugin) is _Precision:
        return RoundPipePrecision("32-true")
    if isinstance(plugin, _MixedPrecision) and plugin.precision == "bf16-mixed":
        return RoundPipePrecision("bf16-mixed")
    name = getattr(plugin, "precision", type(plugin).__name__)
    raise ValueError(
        f"`Trainer(strategy='roundpipe', precision={name!r})` is not supported. roundpipe keeps fp32 master"
        f" weights on the host and computes in a chosen dtype on the workers: use precision='32-true' or"
        f" 'bf16-mixed'."
    )
