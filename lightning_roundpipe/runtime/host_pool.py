"""Host buffers for data in transit: exact-size page-locked buffers, reused once their copies finished.

PyTorch's caching host allocator rounds pinned allocations up to powers of two, which can nearly
double the host memory held for activations. This pool allocates ordinary host tensors of the exact
size and page-locks them with ``cudaHostRegister``; a buffer given back returns to a free list keyed
by size and is handed out again only when every device event it waits for has completed (queried,
never waited on). Without CUDA the pool hands out plain tensors and pins nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten


@dataclass
class Parcel:
    """A nest of host tensors and the device event after which they may be read.

    ``buffers`` are the pool buffers behind ``value``, returned to the pool when the last reader is done.
    """

    value: Any
    ready: Any = None
    buffers: list[Tensor] = field(default_factory=list)


class HostPool:
    """Exact-size host buffers, page-locked when ``pin`` (CUDA present)."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._free: dict[tuple[int, torch.dtype], list[tuple[Tensor, tuple[Any, ...]]]] = {}
        self._registered: list[Tensor] = []
        self._lock = threading.Lock()
        self.pinned_bytes = 0

    def take(self, numel: int, dtype: torch.dtype) -> Tensor:
        """A 1-D buffer of exactly ``numel`` elements (contents undefined)."""
        if not self.pin or numel == 0:
            return torch.empty(numel, dtype=dtype)
        key = (numel, dtype)
        with self._lock:
            free = self._free.get(key, [])
            for i, (buffer, events) in enumerate(free):
                if all(e.query() for e in events):
                    free.pop(i)
                    return buffer
        buffer = torch.empty(numel, dtype=dtype)
        self.register(buffer)
        return buffer

    def give(self, buffer: Tensor, events: Iterable[Any] = ()) -> None:
        """Return a buffer; it is reused once all ``events`` (device events, ``None`` ignored) completed."""
        if not self.pin or buffer.numel() == 0:
            return
        pending = tuple(e for e in events if e is not None)
        with self._lock:
            self._free.setdefault((buffer.numel(), buffer.dtype), []).append((buffer, pending))

    def register(self, tensor: Tensor) -> None:
        """Page-lock an existing contiguous host tensor (e.g. a flat weight buffer) until :meth:`close`."""
        if not self.pin or tensor.numel() == 0:
            return
        nbytes = tensor.numel() * tensor.element_size()
        err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(err)}")
        with self._lock:
            self._registered.append(tensor)
            self.pinned_bytes += nbytes

    def stage(self, tree: Any) -> Parcel:
        """A pinned copy of a nest of host tensors (non-tensor leaves kept), ready at once."""
        if not self.pin:
            return Parcel(tree)
        leaves, spec = tree_flatten(tree)
        out, buffers = [], []
        for leaf in leaves:
            if isinstance(leaf, Tensor):
                buffer = self.take(leaf.numel(), leaf.dtype)
                buffer.view(leaf.shape).copy_(leaf)
                buffers.append(buffer)
                out.append(buffer.view(leaf.shape))
            else:
                out.append(leaf)
        return Parcel(tree_unflatten(out, spec), None, buffers)

    def release(self, parcel: Parcel, events: Iterable[Any] = ()) -> None:
        events = tuple(events)
        for buffer in parcel.buffers:
            self.give(buffer, events)
        parcel.buffers = []

    def close(self) -> None:
        """Unregister every buffer; call only when no device copy can still touch them."""
        with self._lock:
            for tensor in self._registered:
                torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
            self._registered.clear()
            self._free.clear()
            self.pinned_bytes = 0
