"""Worker devices: how one worker moves tensors between host and its device and runs code there.

:class:`WorkerDevice` is the CPU stand-in used where there is no GPU: "uploads" are copies in host
memory and everything runs on the worker's thread. It is the seam for the CUDA data plane, which
replaces these methods with pinned buffers, copy streams and events; the engine only calls what is
defined here.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

# All CPU workers share the process's one CPU generator: seeding and drawing must not interleave.
_CPU_RNG_LOCK = threading.Lock()


class WorkerDevice:
    """The device one worker computes on; this base class is the CPU stand-in."""

    def __init__(self, device: torch.device | str = "cpu", index: int = 0) -> None:
        self.device = torch.device(device)
        self.index = index

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device}, worker={self.index})"

    def enter_thread(self) -> None:
        """Called once on the worker's own thread before it runs anything (per-thread device state)."""

    def upload(self, host: Tensor, requires_grad: bool) -> Tensor:
        """A device copy of a flat host buffer; a leaf that collects gradients if ``requires_grad``."""
        copy = host.detach().clone()
        return copy.requires_grad_(requires_grad)

    def to_device(self, tree: Any) -> Any:
        """Bring activations or gradients stored on the host to this device.

        Always a copy, as a real upload is: in-place operations of a layer must never reach the host
        copy that a recompute reads later.
        """
        return tree_map(_copy, tree)

    def to_host(self, tree: Any) -> Any:
        """Store activations or gradients on the host: a copy detached from any graph."""
        return tree_map(_copy, tree)

    def accumulate(self, host_grad: Tensor, device_grad: Tensor) -> None:
        """Add a stage's gradient into the host gradient buffer."""
        host_grad.add_(device_grad)

    @contextlib.contextmanager
    def seeded(self, seed: int) -> Iterator[None]:
        """Run code with this device's generator seeded to ``seed``, restoring its state afterwards, so
        that a layer draws the same random numbers in its forward and in its recompute."""
        with _CPU_RNG_LOCK:
            generator = torch.default_generator
            state = generator.get_state()
            generator.manual_seed(seed)
            try:
                yield
            finally:
                generator.set_state(state)

    def autocast(self, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
        """Autocast is per thread: each worker enters it itself around its compute."""
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)


def _copy(t: Any) -> Any:
    return t.detach().clone() if isinstance(t, Tensor) else t


def layer_seed(base_seed: int, call: int, microbatch: int, layer: int) -> int:
    """A seed for one layer's randomness on one micro-batch of one pipeline call.

    Depends only on these four numbers (never on the worker), so the forward pass and the recompute
    draw the same dropout masks, and runs with the same seed are reproducible.
    """
    x = base_seed & 0xFFFFFFFFFFFFFFFF
    for v in (call, microbatch, layer):
        x = _splitmix64(x ^ (v & 0xFFFFFFFFFFFFFFFF))
    return x & 0x7FFFFFFFFFFFFFFF


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)
