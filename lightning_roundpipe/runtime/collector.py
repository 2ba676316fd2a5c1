"""Gradient collection: adding a stage's downloaded gradients into the host gradient buffers.

One collector thread per worker, so a worker never stops issuing device work to wait for a copy or
to add on the host. Jobs run in the order the worker submitted them; each waits for the device copy,
then for the previous writer of each gradient group (a chain fixed when the batch was planned), so
gradients are summed in the same order on every run, whatever the thread timing.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from lightning_roundpipe.runtime.device import WorkerDevice
from lightning_roundpipe.runtime.host_store import HostStore
from lightning_roundpipe.runtime.workers import ABORT_POLL_S, Gate, PipelineAborted


@dataclass
class GradJob:
    """Gradients of one slot: ``staging[group]`` is added to ``store.groups[group].grad``; groups copied
    straight into the host buffer need no host work, only the wait for ``ready``."""

    staging: dict[int, Tensor]
    ready: Any
    waits: list[Gate]
    done: Gate
    zero: list[int] = field(default_factory=list)
    """Groups this slot was the first to write but no gradient reached: their host gradient is zeroed."""
    landed: Callable[[], None] | None = None
    """Called once the job's gradients are on the host for good (its flight counts them)."""


class GradCollector:
    """A thread adding one worker's downloaded gradients into the host store."""

    def __init__(
        self, name: str, device: WorkerDevice, store: HostStore, on_error: Callable[[BaseException], None]
    ) -> None:
        self.device = device
        self.store = store
        self._on_error = on_error
        self._jobs: queue.SimpleQueue[GradJob | threading.Event | None] = queue.SimpleQueue()
        self._paced = threading.Condition()
        self._held = 0  # bytes of staging buffers submitted and not yet added
        self._stuck = False  # the job in hand waits for another thread's gate
        self.log: list[tuple[float, float, float, int]] | None = None
        """When a list: (start of the wait for the copy, start of the host adds, their end, bytes added)
        is appended for every job, in ``time.perf_counter`` seconds: where a batch's tail goes."""
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: GradJob) -> None:
        with self._paced:
            self._held += sum(t.nbytes for t in job.staging.values())
        self._jobs.put(job)

    def room(self, nbytes: int, cap: int, abort: threading.Event) -> None:
        """Wait until ``nbytes`` more staging keeps what waits for this collector within ``cap``. Host adds
        are slower than a device makes gradients (one H200: a round of the Qwen3-4B shape's one-block
        measuring stages in 0.49 s, its host adds about 1.6 s), and without a bound its second measuring
        batch held about 32 GiB of staged bf16 gradients (the pool's peak, 33.6 GiB). Not while the job in
        hand waits for another thread's gate (that thread may be waiting here too), and never for the first
        job: it always goes through."""
        with self._paced:
            while self._held and self._held + nbytes > cap and not self._stuck:
                if abort.is_set():
                    raise PipelineAborted
                self._paced.wait(ABORT_POLL_S)

    def _added(self, nbytes: int) -> None:
        with self._paced:
            self._held -= nbytes
            self._paced.notify_all()

    def _waiting_on_gates(self, stuck: bool) -> None:
        with self._paced:
            self._stuck = stuck
            self._paced.notify_all()

    def drain(self) -> None:
        """Wait until every job submitted so far was handled (done, skipped after an abort, or failed)."""
        flushed = threading.Event()
        self._jobs.put(flushed)
        flushed.wait()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if isinstance(job, threading.Event):
                job.set()
                continue
            try:
                waited = time.perf_counter()
                self.device.host_wait(job.ready)
                pending = [gate for gate in job.waits if not gate.happened()]  # (an abort may have opened one)
                if pending:  # only then: an open gate's wait would let a worker past its bound for nothing
                    self._waiting_on_gates(True)
                    for gate in pending:
                        gate.wait()
                    self._waiting_on_gates(False)
                started = time.perf_counter()
                for g in job.zero:
                    grad = self.store.groups[g].grad
                    assert grad is not None
                    grad.zero_()
                added = 0
                for g in list(job.staging):
                    grad = self.store.groups[g].grad
                    assert grad is not None
                    staged = job.staging[g]
                    grad.add_(staged)
                    del job.staging[g]
                    added += staged.nbytes
                    self.device.pool.give(staged)
                    self._added(staged.nbytes)
                if self.log is not None:
                    self.log.append((waited, started, time.perf_counter(), added))
                if job.landed is not None:
                    job.landed()
                job.done.set()
            except PipelineAborted:
                pass
            except BaseException as e:
                self._on_error(e)
            finally:
                if self._stuck:  # an abort during its gates' wait
                    self._waiting_on_gates(False)
                for staged in job.staging.values():  # an aborted job: its buffers go back, after their copy
                    self.device.pool.give(staged, [job.ready])
                    self._added(staged.nbytes)
                job.staging.clear()

    def close(self, timeout: float = 30.0) -> bool:
        """Stop the thread after its queued jobs; ``False`` if it is still running after ``timeout``."""
        self._jobs.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()
