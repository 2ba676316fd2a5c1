"""Update casts done by a device: the optimizer thread queues each updated master, and a thread of this
module has a GPU cast it into the host compute copy (the master up, cast there, the compute dtype down) while
the optimizer thread goes on with the next update's math.

Why: at 8 sequences a step (issue 39) the optimizer thread was the step on one H200's host: 0.49 s of
AdamW math, then 0.19 s casting fp32 masters into bf16 compute copies. The cast is memory traffic on the
thread's cores; the copy engines move the same 6 bytes a parameter through host memory (and 4 + 2 over
PCIe) while the thread computes. Alone on that host the math took 0.41 s, math then cast 0.55 s, the
math beside the device's casts, issued from a second thread, 0.42 s (``benchmarks/host_step.py``,
2026-12-04). Issued from the optimizer thread itself, the copies held it for as long as they took
(0.16 s a step in training): hence a thread of their own, which issues them and waits for them, asleep.

The optimizer worker's edges stay as they are (docs/architecture.md): a group's cast gate opens only
once its compute copy is written (``then``, run by that thread in submission order), and the master may
be written again only once the device has read it (:meth:`UpdateCasts.before_write`). On CPU workers a
thread stands in for the device (tests).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_roundpipe.runtime.host_store import FlatGroup

Wait = Callable[[], None]
CASTS = ("host", "device")
"""Where the asynchronous optimizer casts its updates: on its own thread, or through the workers' devices."""

CHUNK = 8 << 20
"""Elements staged on the device at a time: two chunks in flight, 2 x (32 + 16) MB for fp32 to bf16."""


class CudaCaster:
    """One CUDA device's part: a stream up (copy and cast), a stream down, two staging chunks."""

    def __init__(self, device: torch.device, dtypes: Sequence[torch.dtype] = ()) -> None:
        self.device = device
        self.up: torch.cuda.Stream | None = None
        self.down: torch.cuda.Stream | None = None
        self.staged: dict[tuple[int, torch.dtype], Tensor] = {}
        for dtype in dtypes:  # now, with the engine: not mid-step, where the card may be full
            for slot in (0, 1):
                self._buffer(slot, dtype)

    def _buffer(self, slot: int, dtype: torch.dtype) -> Tensor:
        key = (slot, dtype)
        if key not in self.staged:
            self.staged[key] = torch.empty(CHUNK, dtype=dtype, device=self.device)  # kept for the run
        return self.staged[key]

    def run(self, dst: Tensor, src: Tensor, read: Wait) -> None:
        """``dst.copy_(src)`` through the device, chunk by chunk; ``read()`` once ``src`` was read. Blocking
        events: the waiting thread sleeps rather than spin a core (spinning waits slowed the host's AdamW 1.6x in
        ``host_step.py``)."""
        with torch.cuda.device(self.device):
            if self.up is None:
                low, _ = torch.cuda.Stream.priority_range()
                self.up, self.down = torch.cuda.Stream(priority=low), torch.cuda.Stream(priority=low)
            try:
                self._issue(dst, src, read)
            except BaseException:
                # what was queued still reads the master and writes the copy and the staging buffers: let it
                # finish before the caller opens the gates (best effort: the device may be what failed)
                with contextlib.suppress(BaseException):
                    self.up.synchronize()
                    self.down.synchronize()
                raise

    def _issue(self, dst: Tensor, src: Tensor, read: Wait) -> None:
        assert self.up is not None and self.down is not None
        free: list[torch.cuda.Event | None] = [None, None]
        for i, lo in enumerate(range(0, src.numel(), CHUNK)):
            hi, slot = min(src.numel(), lo + CHUNK), i % 2
            staged, cast = self._buffer(slot, src.dtype)[: hi - lo], self._buffer(slot, dst.dtype)[: hi - lo]
            if free[slot] is not None:
                self.up.wait_event(free[slot])  # the slot's last copy down has left
            with torch.cuda.stream(self.up):
                staged.copy_(src[lo:hi], non_blocking=True)
                cast.copy_(staged)
            casted = torch.cuda.Event(blocking=True)
            casted.record(self.up)
            self.down.wait_event(casted)
            with torch.cuda.stream(self.down):
                dst[lo:hi].copy_(cast, non_blocking=True)
            free[slot] = torch.cuda.Event(blocking=True)
            free[slot].record(self.down)
        casted = torch.cuda.Event(blocking=True)
        casted.record(self.up)
        landed = torch.cuda.Event(blocking=True)
        landed.record(self.down)
        casted.synchronize()
        read()
        landed.synchronize()


class ThreadCaster:
    """The CPU stand-in, on the calling thread: reads ``delay`` seconds late and writes as late again, as a
    device reads the master before its copy lands (tests lengthen it so that a missing wait shows)."""

    delay = 0.0

    def run(self, dst: Tensor, src: Tensor, read: Wait) -> None:
        time.sleep(self.delay)
        staged = src.to(dst.dtype)
        read()
        time.sleep(self.delay)
        dst.copy_(staged)


class UpdateCasts:
    """Casts of updated masters into compute copies, issued and awaited on a thread of their own (issuing
    through CUDA blocked for as long as the copies took: 0.16 s a step on the optimizer thread, H200,
    2026-12-04); groups spread over the devices by index."""

    def __init__(
        self,
        devices: Sequence[torch.device],
        on_error: Callable[[BaseException], None],
        dtypes: Sequence[torch.dtype] = (),
    ) -> None:
        """``dtypes``: those of the masters and copies to be cast, for the staging buffers made now."""
        self._casters = [CudaCaster(d, dtypes) if d.type == "cuda" else ThreadCaster() for d in devices]
        self._on_error = on_error
        self.errors: list[BaseException] = []
        """What went wrong here, also where reporting it failed."""
        self._reads: dict[int, threading.Event] = {}
        self._queue: queue.SimpleQueue[_Cast | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="roundpipe-casts", daemon=True)
        self._thread.start()

    @staticmethod
    def takes(group: FlatGroup) -> bool:
        """Whether ``group``'s casts come here: a trainable group's that change dtype (a plain copy is cheaper at
        home)."""
        return group.trainable and group.compute is not group.data and group.compute.dtype != group.data.dtype

    def cast(self, group: int, dst: Tensor, src: Tensor, then: Wait) -> None:
        """Queue ``dst.copy_(src)``; ``then`` runs on the casts' thread once ``dst`` holds it."""
        read = self._reads[group] = threading.Event()
        self._queue.put(_Cast(then, group, dst, src, read))

    def before_write(self, group: int) -> None:
        """Wait until the device read ``group``'s master for its last cast (the caller will change it)."""
        read = self._reads.pop(group, None)
        if read is not None:
            read.wait()

    def after(self, then: Wait) -> None:
        """Run ``then`` on the casts' thread once every cast queued so far landed."""
        self._queue.put(_Cast(then))

    def close(self, timeout: float = 30.0) -> bool:
        self._queue.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        """Never ends before :meth:`close`: the optimizer thread and ``flush`` wait on what it sets."""
        while (job := self._queue.get()) is not None:
            try:
                if job.dst is not None:
                    assert job.src is not None and job.read is not None
                    self._casters[job.group % len(self._casters)].run(job.dst, job.src, job.read.set)
            except BaseException as e:  # reported first: the abort it sets fails the gate's waiters
                self._report(e)
            finally:
                if job.read is not None:
                    job.read.set()  # never leave the optimizer thread waiting
                try:
                    job.then()
                except BaseException as e:
                    self._report(e)

    def _report(self, error: BaseException) -> None:
        self.errors.append(error)
        try:
            self._on_error(error)
        except BaseException as failed:  # kept in ``errors``; the thread must go on
            self.errors.append(failed)


@dataclass
class _Cast:
    then: Wait
    group: int = 0
    dst: Tensor | None = None
    src: Tensor | None = None
    read: threading.Event | None = None
