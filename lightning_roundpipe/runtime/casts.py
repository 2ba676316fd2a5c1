"""The asynchronous optimizer's casts (each update's masters into the compute copies the next batches upload), on a
thread of their own beside its math.

On the optimizer's one thread update k's casts ran between update k's math and update k+1's. With the states on
the host and short steps that thread was never idle: one H100 capped at 24 GiB, the 1.7B shape, 8 sequences of
256-4096 tokens a step (2026-12-07), 0.62 s of AdamW's math and 0.23 s of casts a step against about 0.5 s of GPU
compute, and the workers waited 0.31 s a batch to write gradients the next math had not read yet. Here a cast
follows its group's math at once, beside the math of the groups after it and of the next update.

A cast of a group waits for the math that wrote its master (``UpdateJob.mastered``) and for the last batch that
reads the copy it overwrites (edge 1 of :mod:`~lightning_roundpipe.runtime.optimizer_worker`); the next update's
math on the group waits for the cast, since it overwrites the master the cast reads. Jobs finish in submission
order: ``UpdateJob.finished`` is set here, after the job's math and casts.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from lightning_roundpipe.runtime.host_store import HostStore
from lightning_roundpipe.runtime.workers import PipelineAborted

if TYPE_CHECKING:
    from lightning_roundpipe.runtime.optimizer_worker import UpdateJob


class CastThread:
    """One thread casting the submitted updates' groups, in submission order."""

    def __init__(
        self,
        store: HostStore,
        cast: Callable[[UpdateJob, int], None],
        on_error: Callable[[BaseException], None],
    ) -> None:
        self.store = store
        self._cast = cast
        self._on_error = on_error
        self._jobs: queue.SimpleQueue[UpdateJob | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="roundpipe-casts", daemon=True)
        self._thread.start()

    def submit(self, job: UpdateJob) -> None:
        """Cast ``job.mastered``'s groups as their math lands; finish the job once its math is done too."""
        self._jobs.put(job)

    def close(self, timeout: float = 30.0) -> bool:
        self._jobs.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._run(job)
                job.math_done.wait()
            except PipelineAborted:
                pass
            except BaseException as e:
                self._on_error(e)
            finally:
                job.finished.set()

    def _run(self, job: UpdateJob) -> None:
        # a group with a spare copy: the copy the step after next reads was last read by this step's batches,
        # so cast it as soon as its math is done; the others once the next step's batches no longer read it
        groups = list(job.mastered)
        spare = [g for g in groups if self.store.groups[g].spare is not None]
        single = [g for g in groups if self.store.groups[g].spare is None]
        for g in spare:
            job.mastered[g].wait()
            for flight in job.window.flights if job.window is not None else ():
                flight.wait_uploaded(g)
            self._cast(job, g)
        if single:
            job.next_window.closed.wait()
        for g in single:
            job.mastered[g].wait()
            for flight in job.next_window.flights:
                flight.wait_uploaded(g)
            self._cast(job, g)
