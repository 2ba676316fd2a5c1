"""Worker devices: streams, events and copies between host and the device one worker drives.

The executor is written once against this interface. :class:`WorkerDevice` is the CPU stand-in:
streams and events are ``None`` and every copy is done when it returns, so the whole engine runs and
is tested without a GPU. :class:`CudaWorkerDevice` gives each worker a compute stream and four copy
streams (activations up, activations down, parameters up, gradients down) ordered with events.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_roundpipe.runtime.host_pool import HostPool, Parcel

# All CPU workers share the process's one CPU generator: seeding and drawing must not interleave.
# Workers that share a CUDA device share its generator the same way.
_RNG_LOCKS: dict[str, threading.Lock] = {}
_RNG_LOCKS_GUARD = threading.Lock()


def _rng_lock(device: torch.device) -> threading.Lock:
    key = str(device)
    with _RNG_LOCKS_GUARD:
        return _RNG_LOCKS.setdefault(key, threading.Lock())


class WorkerDevice:
    """The device one worker computes on; this base class is the CPU stand-in (no streams, no events)."""

    def __init__(self, device: torch.device | str = "cpu", index: int = 0, pool: HostPool | None = None) -> None:
        self.device = torch.device(device)
        self.index = index
        self.pool = pool if pool is not None else HostPool(pin=False)
        self.compute: Any = None
        self.act_up: Any = None
        self.act_down: Any = None
        self.param_up: Any = None
        self.grad_down: Any = None
        self.bytes_up = 0
        self.bytes_down = 0
        self.waited = 0.0
        """Seconds this worker's thread spent waiting for another worker's use of the shared generator."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device}, worker={self.index})"

    # ------------------------------------------------------------------ streams and events
    def enter_thread(self) -> None:
        """Called once on the worker's own thread before it runs anything (per-thread device state)."""

    def on(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Make ``stream`` current for the ops issued inside."""
        return contextlib.nullcontext()

    def record(self, stream: Any) -> Any:
        """An event marking the work issued so far on ``stream`` (``None`` on CPU: already done)."""
        return None

    def new_stream(self) -> Any:
        """A stream of its own (the device optimizer's; ``None`` on CPU)."""
        return None

    def wait(self, stream: Any, event: Any) -> None:
        """Make ``stream`` wait, on the device, for ``event`` (which may come from another device)."""

    def host_wait(self, event: Any) -> None:
        """Block the calling thread until ``event`` completed."""

    def done(self, event: Any) -> bool:
        """Whether ``event`` completed, without waiting."""
        return True

    def keep_alive(self, tensor: Tensor, stream: Any) -> None:
        """Tell the allocator ``tensor`` is used on ``stream``, so freeing it never races that use."""

    def synchronize(self) -> None:
        """Wait for everything issued on this device."""

    def release_cached(self) -> None:
        """Give the allocator's unused cached blocks back (after a batch ran out of memory, or held more than
        the plan's limit)."""

    def reserved(self) -> int:
        """Bytes the caching allocator holds from the device, in use or cached. The CPU stand-in:
        :attr:`held` (what tests set)."""
        return self.held

    def timer(self, stream: Any) -> Any:
        """A point in time on ``stream`` for :meth:`elapsed` and :meth:`since`. The CPU stand-in notes
        the clock and how long the worker has waited for another worker so far (CPU workers share one
        generator), so that durations count compute only."""
        return (time.perf_counter(), self.waited)

    @staticmethod
    def elapsed(start: Any, end: Any) -> float:
        """Compute seconds between two :meth:`timer` points (device events must have completed)."""
        if isinstance(start, tuple):
            return (end[0] - start[0]) - (end[1] - start[1])
        return start.elapsed_time(end) / 1e3

    @staticmethod
    def since(reference: Any, point: Any) -> float:
        """Wall seconds from ``reference`` to ``point`` (for timelines)."""
        if isinstance(reference, tuple):
            return point[0] - reference[0]
        return reference.elapsed_time(point) / 1e3

    # ------------------------------------------------------------------ memory and copies
    def memory_mark(self) -> Any:
        """Start measuring the device memory the calling thread's next work allocates at its peak
        (``None``: this device cannot tell; the CPU stand-in)."""
        return None

    def memory_peak_since(self, mark: Any) -> int:
        """Bytes allocated at the peak since :meth:`memory_mark` beyond what was allocated then."""
        return 0

    def cache_releases(self) -> int:
        """How often this device's caching allocator gave memory back to the driver so far (each time a
        ``cudaFree``, which waits for all the device's queued work). The CPU stand-in has no such cache:
        :attr:`released` (what tests set)."""
        return self.released

    released = 0
    held = 0

    def empty(self, numel: int, dtype: torch.dtype, stream: Any) -> Tensor:
        """A 1-D device buffer allocated for use on ``stream``."""
        return torch.empty(numel, dtype=dtype, device=self.device)

    def copy_up(self, dst: Tensor, src: Tensor, stream: Any) -> None:
        """Host to device copy issued on ``stream``."""
        dst.copy_(src)
        self.bytes_up += src.numel() * src.element_size()

    def copy_down(self, dst: Tensor, src: Tensor, stream: Any) -> None:
        """Device to host copy issued on ``stream``."""
        dst.copy_(src)
        self.bytes_down += src.numel() * src.element_size()

    def upload(self, parcel: Parcel) -> tuple[Any, Any]:
        """Activations or gradients from the host onto this device, on the activations-up stream.

        Waits for ``parcel.ready``; returns the device nest and the event after which it is there.
        Always a copy: in-place operations of a layer must never reach the host copy a recompute reads.
        """
        leaves, spec = tree_flatten(parcel.value)
        with self.on(self.act_up):
            self.wait(self.act_up, parcel.ready)
            out = []
            for leaf in leaves:
                if isinstance(leaf, Tensor):
                    dst = self.empty(leaf.numel(), leaf.dtype, self.act_up).view(leaf.shape)
                    self.copy_up(dst, leaf, self.act_up)
                    self.keep_alive(dst, self.compute)
                    out.append(dst)
                else:
                    out.append(leaf)
            return tree_unflatten(out, spec), self.record(self.act_up)

    def download(self, tree: Any, after: Any) -> Parcel:
        """Activations or gradients from this device into host buffers, on the activations-down stream."""
        leaves, spec = tree_flatten(tree)
        with self.on(self.act_down):
            self.wait(self.act_down, after)
            out, buffers = [], []
            try:
                for leaf in leaves:
                    if isinstance(leaf, Tensor):
                        leaf = leaf.detach()
                        buffer = self.pool.take(leaf.numel(), leaf.dtype)
                        buffers.append(buffer)
                        self.copy_down(buffer.view(leaf.shape), leaf, self.act_down)
                        self.keep_alive(leaf, self.act_down)
                        out.append(buffer.view(leaf.shape))
                    else:
                        out.append(leaf)
            except BaseException:
                issued = self.record(self.act_down)  # after the copies already queued into them
                for buffer in buffers:
                    self.pool.give(buffer, [issued])
                raise
            return Parcel(tree_unflatten(out, spec), self.record(self.act_down), buffers)

    # ------------------------------------------------------------------ compute context
    @contextlib.contextmanager
    def seeded(self, seed: int) -> Iterator[None]:
        """Run code with this device's generator seeded to ``seed``, restoring its state afterwards, so
        that a layer draws the same random numbers in its forward and in its recompute."""
        with self._held():
            generator = self._generator()
            state = generator.get_state()
            generator.manual_seed(seed)
            try:
                yield
            finally:
                generator.set_state(state)

    def generator_held(self) -> contextlib.AbstractContextManager[Any]:
        """Code that puts a state of its own into this device's generator and back (a layer's own checkpoint,
        recomputing in the backward) kept from the other workers that share it: CPU workers share torch's one."""
        return self._held()

    @contextlib.contextmanager
    def _held(self) -> Iterator[None]:
        lock = _rng_lock(self.device)
        if not lock.acquire(blocking=False):
            waited = time.perf_counter()
            lock.acquire()
            self.waited += time.perf_counter() - waited
        try:
            yield
        finally:
            lock.release()

    def _generator(self) -> torch.Generator:
        return torch.default_generator

    def autocast(self, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
        """Autocast is per thread: each worker enters it itself around its compute."""
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)


_CLEARED_PEAKS: dict[int, int] = {}
"""Per CUDA device index: the highest peak that a profiling reset cleared from PyTorch's counter."""
_CLEARED_PEAKS_LOCK = threading.Lock()


def _cuda_index(device: torch.device | str | int | None) -> int:
    if isinstance(device, int):
        return device
    index = None if device is None else torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def max_memory_allocated(device: torch.device | str | int | None = None) -> int:
    """What ``torch.cuda.max_memory_allocated`` would say had the layer profiling not reset it.

    Measuring each action's peak needs PyTorch's peak counter reset before the action, which clears the
    peak anyone else was reading (a benchmark, ``DeviceStatsMonitor``). The engine folds each peak it is
    about to clear into a record first; this is the larger of the record and the counter. Pair it with
    :func:`reset_peak_memory_stats`."""
    index = _cuda_index(device)
    with _CLEARED_PEAKS_LOCK:
        return max(_CLEARED_PEAKS.get(index, 0), torch.cuda.max_memory_allocated(index))


def reset_peak_memory_stats(device: torch.device | str | int | None = None) -> None:
    """``torch.cuda.reset_peak_memory_stats`` and the record :func:`max_memory_allocated` adds."""
    index = _cuda_index(device)
    with _CLEARED_PEAKS_LOCK:
        _CLEARED_PEAKS.pop(index, None)
        torch.cuda.reset_peak_memory_stats(index)


def expandable_segments() -> bool:
    """Let torch's CUDA caching allocator grow expandable segments, unless the process's allocator settings
    (``PYTORCH_CUDA_ALLOC_CONF``, ``PYTORCH_ALLOC_CONF``) already say either way. Micro-batches of changing
    sizes (padded batches cut by tokens) leave blocks of every size cached: on an H200 the default
    allocator reserved 138.7 GiB for a 60 GiB peak and 32 x 256..4096 tokens a step ran 30,286 tokens/s;
    with expandable segments 76.4 GiB for 70.5 GiB, 35,347 tokens/s (2026-12-03, docs/benchmarks.md).
    Returns whether it switched them on (settings apply to segments allocated from then on)."""
    configured = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if "expandable_segments" in configured or setter is None:
        return False
    setter("expandable_segments:True")
    return True


class CudaWorkerDevice(WorkerDevice):
    """One CUDA device: a compute stream and four copy streams, created on the worker's thread."""

    def enter_thread(self) -> None:
        torch.cuda.set_device(self.device)
        # Activation copies are on the critical path: give their streams the higher priority.
        low, high = torch.cuda.Stream.priority_range()
        self.compute = torch.cuda.Stream(self.device)
        self.act_up = torch.cuda.Stream(self.device, priority=high)
        self.act_down = torch.cuda.Stream(self.device, priority=high)
        self.param_up = torch.cuda.Stream(self.device, priority=low)
        self.grad_down = torch.cuda.Stream(self.device, priority=low)

    def on(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def record(self, stream: Any) -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def new_stream(self) -> Any:
        return torch.cuda.Stream(self.device)

    def wait(self, stream: Any, event: Any) -> None:
        if event is not None:
            stream.wait_event(event)

    def host_wait(self, event: Any) -> None:
        if event is not None:
            event.synchronize()

    def done(self, event: Any) -> bool:
        return event is None or event.query()

    def keep_alive(self, tensor: Tensor, stream: Any) -> None:
        if tensor.device.type == "cuda":
            tensor.record_stream(stream)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def release_cached(self) -> None:
        with torch.cuda.device(self.device):
            torch.cuda.empty_cache()

    def cache_releases(self) -> int:
        return int(torch.cuda.memory_stats(self.device).get("num_device_free", 0))

    def reserved(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))

    def timer(self, stream: Any) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def memory_mark(self) -> Any:
        # the caching allocator's own count, at allocation time: what the device must hold
        index = _cuda_index(self.device)
        with _CLEARED_PEAKS_LOCK:  # keep the peak the reset clears: see max_memory_allocated
            base = torch.cuda.memory_allocated(index)
            _CLEARED_PEAKS[index] = max(_CLEARED_PEAKS.get(index, 0), torch.cuda.max_memory_allocated(index))
            torch.cuda.reset_peak_memory_stats(index)
        return base

    def memory_peak_since(self, mark: Any) -> int:
        return max(0, torch.cuda.max_memory_allocated(self.device) - mark)

    def empty(self, numel: int, dtype: torch.dtype, stream: Any) -> Tensor:
        with torch.cuda.stream(stream):
            return torch.empty(numel, dtype=dtype, device=self.device)

    def copy_up(self, dst: Tensor, src: Tensor, stream: Any) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        self.bytes_up += src.numel() * src.element_size()

    def copy_down(self, dst: Tensor, src: Tensor, stream: Any) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        self.bytes_down += src.numel() * src.element_size()

    def _generator(self) -> torch.Generator:
        return torch.cuda.default_generators[self.device.index or 0]

    def generator_held(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()  # (one worker to a GPU: its generator is its own)


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
