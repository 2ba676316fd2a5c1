"""Worker threads: one daemon thread per device taking tasks from a queue, and abortable gates between them.

A task that raises hands its exception to the pool's ``on_error`` callback at once (so the engine can
open every gate and let the other workers stop) and keeps it for the caller, who re-raises it in the
main thread with its original traceback. Nothing here knows about stages or plans.
"""

from __future__ import annotations

import contextvars
import queue
import threading
from collections.abc import Callable, Sequence

_STOP = object()


class PipelineAborted(Exception):
    """Raised inside workers waiting at a gate once the pipeline was aborted; never reaches users."""


class EitherEvent:
    """Set once either of two events is: the engine's abort or one batch's own failure (what a
    guarded flight's gates and workers check)."""

    __slots__ = ("_events",)

    def __init__(self, *events: threading.Event) -> None:
        self._events = events

    def is_set(self) -> bool:
        return any(e.is_set() for e in self._events)


ABORT_POLL_S = 0.05
"""How often a thread waiting for another checks the abort: a wait never outlives it by more."""


class Gate:
    """A one-shot signal between threads that an abort can open early.

    ``wait`` returns once the gate is set, or raises :class:`PipelineAborted` once the pipeline is
    aborted (opened or not), so no thread waits forever on work that will never happen.
    """

    __slots__ = ("_abort", "_event", "_happened")

    def __init__(self, abort: threading.Event | EitherEvent) -> None:
        self._event = threading.Event()
        self._abort = abort
        self._happened = False

    def set(self) -> None:
        self._happened = True  # (first: a waiter woken by it finds it so)
        self._event.set()

    def force(self) -> None:
        """Open it for an abort: the waiters wake, but what it stands for did not happen."""
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def happened(self) -> bool:
        """Set by the work it stands for, not only opened by an abort."""
        return self._happened

    def wait(self) -> None:
        # Wakes on the abort too, even when nobody sets this gate any more (a gate of a batch that had
        # already left the engine's books when another thread failed): a wait never outlives an abort.
        while not self._event.wait(ABORT_POLL_S):
            if self._abort.is_set():
                raise PipelineAborted
        if self._abort.is_set():
            raise PipelineAborted


class Task:
    """A callable submitted to one worker, with its completion event and error."""

    __slots__ = ("done", "error", "fn")

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.error: BaseException | None = None


class WorkerPool:
    """Daemon threads, one per worker; ``thread_init[i]`` runs first on thread ``i``."""

    def __init__(
        self,
        names: Sequence[str],
        thread_init: Sequence[Callable[[], None]],
        on_error: Callable[[BaseException], None],
    ) -> None:
        self._queues: list[queue.SimpleQueue[object]] = [queue.SimpleQueue() for _ in names]
        self._on_error = on_error
        # each thread runs in a copy of the creating thread's context: settings kept in context variables
        # (torch.compile's configuration, from torch 2.12 on) reach the workers as the main thread set them
        self._threads = [
            threading.Thread(target=contextvars.copy_context().run, args=(self._loop, q, init), name=name, daemon=True)
            for q, init, name in zip(self._queues, thread_init, names)
        ]
        for t in self._threads:
            t.start()

    def __len__(self) -> int:
        return len(self._threads)

    def submit(self, worker: int, fn: Callable[[], None]) -> Task:
        if not self._threads[worker].is_alive():
            raise RuntimeError(f"roundpipe worker {worker} is not running (the pool was closed or its thread died)")
        task = Task(fn)
        self._queues[worker].put(task)
        return task

    def _loop(self, tasks: queue.SimpleQueue[object], init: Callable[[], None]) -> None:
        init_error: BaseException | None = None
        try:
            init()
        except BaseException as e:  # reported with the first task, in the caller's thread
            init_error = e
        while True:
            task = tasks.get()
            if task is _STOP:
                return
            assert isinstance(task, Task)
            try:
                if init_error is not None:
                    raise init_error
                task.fn()
            except PipelineAborted:
                pass
            except BaseException as e:
                task.error = e
                self._on_error(e)
            finally:
                task.done.set()

    def close(self, timeout: float = 30.0) -> list[str]:
        """Stop every thread after its queued tasks; returns the names of threads still alive after
        ``timeout`` seconds (stuck in user code: they are daemons and cannot keep the process alive)."""
        for q in self._queues:
            q.put(_STOP)
        for t in self._threads:
            t.join(timeout)
        return [t.name for t in self._threads if t.is_alive()]
