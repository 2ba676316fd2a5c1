"""The engine's threads and their lifetime: one worker per device (with its executor and gradient
collector), the optimizer thread, the batches they are running, and the one abort that stops them all.

Any thread that fails hands its exception to :meth:`Crew.on_error`: the first error is kept, the abort
is set and every gate a thread could be waiting on is opened (the live flights' here, the step chain's
through :meth:`Crew.when_aborted`), so every other thread stops instead of waiting forever. The main
thread then re-raises the kept error with its original traceback.
"""

from __future__ import annotations

import threading
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NoReturn

import torch
from torch import nn

from lightning_roundpipe.runtime.callers import outside_package
from lightning_roundpipe.runtime.collector import GradCollector
from lightning_roundpipe.runtime.device import WorkerDevice
from lightning_roundpipe.runtime.executor import StageExecutor
from lightning_roundpipe.runtime.flight import Flight
from lightning_roundpipe.runtime.host_pool import HostPool
from lightning_roundpipe.runtime.host_store import HostStore
from lightning_roundpipe.runtime.optimizer_worker import OptimizerWorker
from lightning_roundpipe.runtime.replicas import plain_attributes
from lightning_roundpipe.runtime.resident import ResidentStates
from lightning_roundpipe.runtime.workers import Task, WorkerPool
from lightning_roundpipe.schedule.plan import StagePlan


class Crew:
    """Worker threads, collectors and the optimizer thread of one engine, and their failure state."""

    def __init__(
        self,
        layers: Sequence[nn.Module],
        devices: Sequence[WorkerDevice],
        store: HostStore,
        pool: HostPool,
        plan: StagePlan,
        base_seed: int,
        autocast_dtype: torch.dtype | None,
        overlap: str,
        max_inflight: int,
        asynchronous: bool,
    ) -> None:
        self.layers = layers
        self.devices = list(devices)
        self.abort = threading.Event()
        self.error: BaseException | None = None
        """The first error any thread raised since the last :meth:`reset`."""
        self.failed = False
        """Unusable: a batch was cut short where its state could not be recovered."""
        self.closed = False
        self._lock = threading.Lock()
        self._live: list[tuple[Flight, list[Task]]] = []
        self.recent: deque[Flight] = deque(maxlen=5)
        """The last flights whose workers finished (what :func:`~lightning_roundpipe.engine.stats.worker_waits`
        reads)."""
        self._on_abort: list[Callable[[], None]] = []
        self.collectors: list[GradCollector] = []
        self.executors: list[StageExecutor] = []
        for i, device in enumerate(self.devices):
            device.pool = pool
            collector = GradCollector(f"roundpipe-collector-{i}", device, store, self.on_error)
            self.collectors.append(collector)
            executor = StageExecutor(
                device, store, layers, plan, base_seed, autocast_dtype, collector, self.on_error, overlap, max_inflight
            )
            self.executors.append(executor)
        self.optimizer = OptimizerWorker(store, self.on_error) if asynchronous else None
        self._threads = WorkerPool(
            [f"roundpipe-worker-{i}" for i in range(len(self.devices))],
            [d.enter_thread for d in self.devices],
            self.on_error,
        )

    def use_resident(self, resident: ResidentStates | None) -> None:
        """``optimizer_on="device"``: the worker and the optimizer thread work on ``resident`` (``None``: the host)."""
        if resident is not None:
            self.executors[0].slots.resident = resident
            assert self.optimizer is not None
            self.optimizer.resident = resident

    @property
    def num_workers(self) -> int:
        return len(self.devices)

    # ------------------------------------------------------------------ running batches
    def launch(self, flight: Flight, settle: bool) -> list[Task]:
        """Hand each worker its actions of ``flight``'s schedule; the flight is live until they finish."""
        attributes = plain_attributes(self.layers)
        with self._lock:
            self._live.append((flight, []))
        tasks = self._live[-1][1]
        for w, executor in enumerate(self.executors):
            run = partial(executor.run, flight.schedule.workers[w], flight, attributes, settle=settle)
            tasks.append(self._threads.submit(w, run))
        return tasks

    def finished(self, flight: Flight) -> bool:
        """Whether no worker runs ``flight`` any more."""
        return all(t.done.is_set() for f, tasks in self._live if f is flight for t in tasks)

    def busy(self) -> bool:
        """Whether any batch is still running (or was never waited for)."""
        return bool(self._live)

    def prune(self) -> None:
        """Forget the flights whose workers are done (the last few stay in :attr:`recent`)."""
        with self._lock:
            self.recent.extend(f for f, tasks in self._live if all(t.done.is_set() for t in tasks))
            self._live = [(f, tasks) for f, tasks in self._live if not all(t.done.is_set() for t in tasks)]

    def wait_live(self, timeout: float | None = None) -> None:
        with self._lock:
            live = list(self._live)
        for _, tasks in live:
            for task in tasks:
                task.done.wait(timeout=timeout)

    def drain(self) -> None:
        """Wait until every gradient job submitted so far was handled."""
        for collector in self.collectors:
            collector.drain()

    def settle(self, tasks: list[Task], recover: Callable[[], None] | None) -> None:
        """Wait for a batch's tasks. If a worker failed, ``recover()`` gives the batch up and its error is
        raised here. An interrupt of this wait (Ctrl-C) stops every worker, and once they all stopped
        ``recover()`` runs before it propagates. Without ``recover``, or with a worker still running
        30 s after the interrupt, the crew is marked failed instead: its buffers are left alone."""
        try:
            for task in tasks:
                task.done.wait()
        except BaseException as interrupt:
            self.on_error(interrupt)
            if all([task.done.wait(timeout=30.0) for task in tasks]) and recover is not None:
                recover()
            else:
                self.failed = True
            raise
        finally:
            self.prune()
        if self.error is not None:
            if recover is None:
                self.fail()
            error = self.error
            recover()
            raise error

    def synchronize(self) -> None:
        for device in self.devices:
            device.synchronize()

    # ------------------------------------------------------------------ failures
    def check_usable(self) -> None:
        """Refuse work after :meth:`close` or a failure; an asynchronous thread's error is raised here."""
        if self.closed:
            raise RuntimeError("this roundpipe engine was closed; set up a new one (a new Trainer.fit does)")
        if self.failed:
            raise RuntimeError("this roundpipe engine stopped after an error in a worker; set up a new one")
        if self.optimizer is not None and self.error is not None:
            self.fail()

    def when_aborted(self, opener: Callable[[], None]) -> None:
        """Call ``opener`` on an abort, to open gates that the live flights do not own."""
        self._on_abort.append(opener)

    def on_error(self, error: BaseException) -> None:
        """Any thread's failure (or an interrupt of the main thread's wait): stop everyone."""
        with self._lock:
            if self.error is None:
                self.error = error
            self.abort.set()
            for flight, _ in self._live:
                flight.open_all_gates()
            for opener in self._on_abort:
                opener()

    def stop(self) -> None:
        """After an error: stop every thread and wait for them, without raising. An update whose gradients had all
        landed finishes first (a few host steps' time allowed); one cut short midway, or still running, is said."""
        self.on_error(RuntimeError("aborted"))
        self.wait_live(timeout=30.0)
        self.drain()
        if self.optimizer is not None:
            last = self.optimizer.last_update
            timeout = 30.0 + 3 * (last[1] if last is not None else 0.0)
            if not self.optimizer.wait_all(timeout=timeout):
                warnings.warn(
                    f"roundpipe: the update under way at the failure was still running {timeout:.0f} s later; the"
                    " module's weights may change until it ends",
                    stacklevel=outside_package(),
                )
            elif (cut := self.optimizer.cut_short) is not None:
                warnings.warn(
                    f"roundpipe: the failure stopped an update after {cut[0]} of its {cut[1]} parameter groups (the"
                    " step's gradients were incomplete): the module's weights now mix two steps; do not resume"
                    " from them, but from an earlier checkpoint",
                    stacklevel=outside_package(),
                )
        self.failed = True

    def fail(self) -> NoReturn:
        """Stop everything after an error (:meth:`stop`) and raise it; the engine is not reusable, but the process
        is not stuck and no thread keeps running."""
        self.stop()
        error = self.error
        assert error is not None
        raise error

    def after_failure(self, step: int) -> bool:
        """After a failure, with no thread running: what the steps changed in the optimizer's groups, and the device's
        values (states on the device), on the host, for a checkpoint of whole steps. ``False``: no failure, or one
        on several nodes (the flush then raises it again: a save would gather from nodes that may not have failed)."""
        if not self.failed or self.optimizer is None or self.optimizer.exchange is not None:
            return False
        if not self.optimizer.wait_all(timeout=0):  # (its thread still runs: the save is refused below)
            return True
        self.optimizer.groups_to_host()
        if self.optimizer.resident is not None:
            self.optimizer.resident.rescue(step)
        return True

    def whole_after_failure(self) -> bool:
        """Whether a checkpoint may be written: no failure, or one after which every submitted update reached the
        masters whole (Lightning's step count then matches them); a warning says why not."""
        optimizer = self.optimizer
        if not self.failed or optimizer is None:
            return True
        running = not optimizer.wait_all(timeout=0)
        if not running and optimizer.all_updated():
            return True
        why = "still runs" if running else "did not finish (the failure cut it short)"
        warnings.warn(
            f"roundpipe: no checkpoint written after the failure: the update of the last step Lightning counted {why},"
            " so the weights do not hold the steps it counted; resume from an earlier checkpoint",
            stacklevel=outside_package(),
        )
        return False

    def reset(self) -> None:
        """Ready again after a batch was given up (no thread runs it any more)."""
        self.error = None
        self.abort.clear()

    def close(self) -> list[str]:
        """Stop every thread after its queued work; the names of those still running after the timeout."""
        self.closed = True
        if self.optimizer is not None and not self.optimizer.wait_all(timeout=0):
            self.on_error(RuntimeError("closed"))
        stuck = self._threads.close()
        stuck += [f"roundpipe-collector-{i}" for i, c in enumerate(self.collectors) if not c.close()]
        if self.optimizer is not None and not self.optimizer.close():
            stuck.append("roundpipe-optimizer")
        self.synchronize()
        self.give_back_ahead()
        return stuck

    def give_back_ahead(self) -> None:
        """Drop each worker's buffers taken for its next batch's first upload: before the caches go back to the
        device (a rebuild, a recovery) and at the end, they are not left in a stream's pool nothing allocates from."""
        for executor in self.executors:
            executor.give_back_ahead()

    # ------------------------------------------------------------------ for tests and benchmarks
    def set_seed(self, base_seed: int) -> None:
        for executor in self.executors:
            executor.base_seed = base_seed

    def record_trace(self) -> list[tuple[Any, ...]]:
        """Start recording when each action and each group update started (for tests and timelines)."""
        trace: list[tuple[Any, ...]] = []
        for executor in self.executors:
            executor.trace = trace
        if self.optimizer is not None:
            self.optimizer.trace = trace
        return trace

    def log_gradient_adds(self, log: list[tuple[float, float, float, int]] | None) -> None:
        """Append every gradient job's (start of the wait for its copy, start of its host adds, their
        end, bytes added) to ``log``, in ``time.perf_counter`` seconds; ``None`` stops. For benchmarks:
        where a batch's tail goes."""
        for collector in self.collectors:
            collector.log = log

    def transferred_bytes(self) -> tuple[int, int]:
        """Bytes copied host-to-device and device-to-host by all workers so far."""
        return sum(d.bytes_up for d in self.devices), sum(d.bytes_down for d in self.devices)
