"""Host buffers for data in transit: exact-size page-locked buffers, reused once their copies finished.

PyTorch's caching host allocator rounds pinned allocations up to powers of two, which can nearly
double the host memory held for activations. This pool allocates ordinary host tensors of the exact
size and page-locks them with ``cudaHostRegister``; a buffer given back returns to a free list keyed
by size and is handed out again only when every device event it waits for has completed (queried,
never waited on). A request no idle buffer of its size answers takes the smallest idle one up to
:attr:`HostPool.reuse_within` times larger (a view of its start) before a new one is made, and buffers
idle for :attr:`HostPool.idle_batches` batches are given back (:meth:`HostPool.tick`): micro-batches of
changing sizes (padded batches cut by tokens) otherwise leave buffers of sizes nobody asks for again, and
the host's resident memory climbed 1.3-3.5 GiB a step until the machine ran short (H200, 24 GiB card,
2026-12-03). Without CUDA the pool hands out plain tensors and pins nothing.

At long sequences these buffers, not the model states, are what fills the host. Before allocating,
the pool compares what it is about to take with the memory the machine has available, and raises
:class:`HostMemoryError` on the thread that asked, naming what to change, rather than let the kernel's
OOM killer end the process halfway through a step (no traceback, no checkpoint).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_roundpipe.runtime.host_memory import available_host_memory, host_memory_limit

GiB = 2**30


class HostMemoryError(MemoryError):
    """A host buffer the step needs would not fit in the memory the machine has left."""


def available_host_bytes() -> int:
    return available_host_memory()  # cgroup limits included


def default_reserve() -> int:
    """Memory left to everything else (the OS, Python objects, the optimizer's temporaries): 2 GiB or
    1/32 of the memory this process may use (the machine's, or its cgroup's limit), whichever is more."""
    return max(2 * GiB, host_memory_limit() // 32)


@dataclass
class Parcel:
    """A nest of host tensors and the device event after which they may be read.

    ``buffers`` are the pool buffers behind ``value``, returned to the pool when the last reader is done.
    """

    value: Any
    ready: Any = None
    buffers: list[Tensor] = field(default_factory=list)


class HostPool:
    """Exact-size host buffers, page-locked when ``pin`` (CUDA present).

    ``available`` says how many bytes the machine has free (read at most once per ``check_every`` bytes
    of new buffers, and for every buffer at least that large: reading it costs about 50 us);
    ``reserve`` is what a new buffer must leave free."""

    check_every = 256 * 2**20
    reuse_within = 1.25
    """An idle buffer up to this many times the request's size answers it (the rest unused meanwhile)."""
    idle_batches = 2
    """Batches a buffer may sit idle in the pool before :meth:`tick` gives it back."""

    def __init__(self, pin: bool, available: Callable[[], int] | None = None, reserve: int | None = None) -> None:
        self.pin = pin
        self.available = available_host_bytes if available is None else available
        self.reserve = default_reserve() if reserve is None else reserve
        self._unchecked = 0
        self._free: dict[tuple[int, torch.dtype], list[tuple[Tensor, tuple[Any, ...], int]]] = {}
        """Idle buffers by size: each with the events its copies wait for and the tick it came back in."""
        self._ticks = 0
        self._registered: list[Tensor] = []
        self._lock = threading.Lock()
        self.pinned_bytes = 0
        """Bytes page-locked: tensors registered from outside plus the pool's own buffers."""
        self.buffer_bytes = 0
        """Bytes of the pool's own (pinned) buffers: the most that was in transit at once, or waiting."""
        self.peak_buffer_bytes = 0
        """The most :attr:`buffer_bytes` ever held (trimming lowers the one, never the other)."""

    def _make_room(self, numel: int, dtype: torch.dtype) -> None:
        nbytes = numel * dtype.itemsize
        with self._lock:
            self._unchecked += nbytes
            if self._unchecked < self.check_every and nbytes < self.check_every:
                return
            self._unchecked = 0
        left = self.available() - nbytes
        if left < self.reserve and self._trim(self.reserve - left):  # idle buffers of other sizes go first
            left = self.available() - nbytes
        if left < self.reserve:
            raise HostMemoryError(
                f"roundpipe: host memory: a {nbytes / GiB:.2f} GiB buffer for activations or gradients in"
                f" transit would leave {left / GiB:.2f} GiB of the machine's memory free, under the"
                f" {self.reserve / GiB:.2f} GiB kept for everything else ({self.pinned_bytes / GiB:.2f} GiB"
                " page-locked by roundpipe so far). The stage boundaries of every micro-batch in a step wait"
                " on the host for backward: train on shorter sequences or fewer tokens per batch (more"
                " gradient accumulation keeps the tokens per optimizer step), or on a host with more memory."
            )

    def _trim(self, need: int, before: int | None = None) -> int:
        """Unpin and drop free buffers whose copies have finished (``before``: only those back since before
        that tick), largest first, until ``need`` bytes are given back (batches of changing shapes leave
        buffers of sizes nobody asks for again); returns the bytes given back."""
        with self._lock:
            idle = [
                b for free in self._free.values() for b, events, back in free
                if all(e.query() for e in events) and (before is None or back < before)
            ]  # fmt: skip
            idle.sort(key=lambda b: b.numel() * b.element_size(), reverse=True)
            chosen, freed = [], 0
            for buffer in idle:
                if freed >= need:
                    break
                chosen.append(buffer)
                freed += buffer.numel() * buffer.element_size()
            if not chosen:
                return 0
            ids = {id(b) for b in chosen}
            for key in list(self._free):
                self._free[key] = [entry for entry in self._free[key] if id(entry[0]) not in ids]
                if not self._free[key]:
                    del self._free[key]  # changing shapes would keep a key per size ever seen
            self._registered = [t for t in self._registered if id(t) not in ids]
            for buffer in chosen:
                torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
            self.pinned_bytes -= freed
            self.buffer_bytes -= freed
        return freed  # the unpinned buffers go with the last references: ``idle`` and ``chosen`` here

    def trim_idle(self) -> int:
        """Unpin and drop every idle buffer (after a change of plan or micro-batch size, buffers of the old
        sizes would otherwise stay until the host runs short); returns the bytes given back."""
        return self._trim(1 << 62) if self.pin else 0

    def tick(self) -> int:
        """A batch begins: buffers idle since before the last :attr:`idle_batches` batches are given back;
        returns the bytes given back."""
        self._ticks += 1
        return self._trim(1 << 62, before=self._ticks - self.idle_batches) if self.pin else 0

    def take(self, numel: int, dtype: torch.dtype) -> Tensor:
        """A 1-D buffer of exactly ``numel`` elements (contents undefined)."""
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        if not self.pin:
            self._make_room(numel, dtype)
            return torch.empty(numel, dtype=dtype)
        with self._lock:
            sizes = sorted(n for n, d in self._free if d == dtype and numel <= n <= numel * self.reuse_within)
            for size in sizes:  # its own size first, then the smallest idle one larger
                free = self._free[(size, dtype)]
                for i, (buffer, events, _) in enumerate(free):
                    if all(e.query() for e in events):
                        free.pop(i)
                        if not free:
                            del self._free[(size, dtype)]
                        return buffer if size == numel else buffer[:numel]
        self._make_room(numel, dtype)
        buffer = torch.empty(numel, dtype=dtype)
        self.register(buffer)
        with self._lock:
            self.buffer_bytes += buffer.numel() * buffer.element_size()
            self.peak_buffer_bytes = max(self.peak_buffer_bytes, self.buffer_bytes)
        return buffer

    def free_bytes(self) -> int:
        """Bytes of the pool's own buffers that are back in it (waiting for reuse)."""
        with self._lock:
            return sum(b.numel() * b.element_size() for free in self._free.values() for b, *_ in free)

    def give(self, buffer: Tensor, events: Iterable[Any] = ()) -> None:
        """Return a buffer; it is reused once all ``events`` (device events, ``None`` ignored) completed."""
        if not self.pin or buffer.numel() == 0:
            return
        pending = tuple(e for e in events if e is not None)
        base = buffer if buffer._base is None else buffer._base  # a larger buffer's start went out
        with self._lock:
            self._free.setdefault((base.numel(), base.dtype), []).append((base, pending, self._ticks))

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
        try:
            for leaf in leaves:
                if isinstance(leaf, Tensor):
                    buffer = self.take(leaf.numel(), leaf.dtype)
                    buffers.append(buffer)
                    buffer.view(leaf.shape).copy_(leaf)
                    out.append(buffer.view(leaf.shape))
                else:
                    out.append(leaf)
        except BaseException:
            for buffer in buffers:  # host copies only: nothing on a device reads them yet
                self.give(buffer)
            raise
        return Parcel(tree_unflatten(out, spec), None, buffers)

    def stage_all(self, trees: list[Any]) -> list[Parcel]:
        """:meth:`stage` for each tree, all or none (a failure gives back what it took)."""
        parcels: list[Parcel] = []
        try:
            for tree in trees:
                parcels.append(self.stage(tree))
        except BaseException:
            for parcel in parcels:
                self.release(parcel)
            raise
        return parcels

    def release(self, parcel: Parcel, events: Iterable[Any] = ()) -> None:
        """Give back a parcel's buffers; a parcel released twice gives them back once."""
        events = tuple(events)
        with self._lock:
            buffers, parcel.buffers = parcel.buffers, []
        for buffer in buffers:
            self.give(buffer, events)

    def close(self) -> None:
        """Unregister every buffer; call only when no device copy can still touch them."""
        with self._lock:
            for tensor in self._registered:
                torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
            self._registered.clear()
            self._free.clear()
            self.pinned_bytes = self.buffer_bytes = 0
