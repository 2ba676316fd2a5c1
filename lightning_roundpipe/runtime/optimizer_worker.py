"""The asynchronous host optimizer: applies update k on the host while the workers compute step k+1.

Staleness is exactly one step: every upload of a group during step k reads the compute copy of the
masters after updates ``0..k-2``. Ordering is per flat group (a slice of one layer), never a global
barrier, by five edges (paper section 4.3):

1. the cast of update k into a group's compute copy waits for step k+1's last upload of that group
   (double buffering, see :mod:`~lightning_roundpipe.runtime.host_store`: for step k's, since step
   k+1 reads the other copy);
2. step k+2's first upload of the group waits for that cast;
3. update k's math on a group waits for step k's last gradient write to it;
4. step k+1's first gradient write to the group waits for update k's math on it (the gradients were
   read): one fp32 gradient buffer serves both;
5. updates run in submission order, on one thread.

The user's optimizer is driven through a *shadow* (:mod:`~lightning_roundpipe.runtime.shadow`): the same
class, attributes and per-parameter state dicts, but its own parameter objects (sharing storage with the real
ones) and its own ``param_groups``, which take what the main thread changed at each submission. So Lightning's
``zero_grad`` and LR schedulers on the main thread never race the worker; checkpoints read the real optimizer's
(shared) state. An optimizer whose step couples its parameters is stepped once, after the step's last gradient.
"""

from __future__ import annotations

import collections
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_roundpipe.runtime.exchange import NodeExchange
from lightning_roundpipe.runtime.host_store import HostStore
from lightning_roundpipe.runtime.one_pass import one_pass_items, step_and_cast
from lightning_roundpipe.runtime.shadow import GroupSync, shadow_optimizer, steps_apart
from lightning_roundpipe.runtime.updates import UpdateJob
from lightning_roundpipe.runtime.workers import PipelineAborted

if TYPE_CHECKING:
    from lightning_roundpipe.runtime.resident import ResidentStates


class OptimizerWorker:
    """One thread applying submitted updates in order."""

    def __init__(
        self,
        store: HostStore,
        on_error: Callable[[BaseException], None],
        trace: list[tuple[Any, ...]] | None = None,
        exchange: NodeExchange | None = None,
    ) -> None:
        self.store = store
        self.exchange = exchange
        """Several nodes: gradients go to each group's owner, which updates it and broadcasts the weights."""
        self.trace = trace
        self._on_error = on_error
        self._jobs: queue.SimpleQueue[UpdateJob | None] = queue.SimpleQueue()
        self._last: UpdateJob | None = None
        self._shadows: dict[tuple[int, ...], Shadow] = {}
        self.grad_norms: collections.deque[tuple[int, float]] = collections.deque(maxlen=256)
        """(step, global 2-norm of its gradients before clipping) of the recent updates that computed it."""
        self.scales: dict[int, float] = {}
        """``16-mixed``: per update, the loss scale after its decision (halved after non-finite gradients,
        grown after ``growth_interval`` finite steps), as :meth:`scale_after` hands it to later steps."""
        self._decided: dict[int, threading.Event] = {}
        self._decided_lock = threading.Lock()
        self.updated: int | None = None
        """The step of the last update whose math finished whole (a skipped one counts): after a failure, whether
        the masters hold every submitted update."""
        self.cut_short: tuple[int, int] | None = None
        """(groups updated, groups) of an update an abort stopped midway (its gradients incomplete: a failure in
        its own step's backward, after the deep groups' update began): the weights then mix two steps."""
        self.last_update: tuple[int, float] | None = None
        """The last update's step and the host seconds its math took (clipping and the optimizer's steps; not
        the waits for gradients, nor the casts): what the devices' step must be longer than for it to hide."""
        self.one_pass_groups = 0  # group updates the one-pass kernel made (a benchmark's evidence that it ran)
        self.resident: ResidentStates | None = None
        """``optimizer_on="device"``: the states the updates run on (none of this thread's host math or casts)."""
        self._thread = threading.Thread(target=self._loop, name="roundpipe-optimizer", daemon=True)
        self._thread.start()

    def submit(self, job: UpdateJob) -> None:
        self._last = job
        self._jobs.put(job)

    def wait_math(self) -> None:
        """Wait until every submitted update changed the masters (casts may still be pending); then what the
        steps changed in the shadow's parameter groups (a step count) is in the real optimizer's too."""
        if self._last is not None:
            self._last.math_done.wait()
        self.groups_to_host()

    def all_updated(self) -> bool:
        """Whether every submitted update's math finished whole (none cut short by a failure)."""
        return self._last is None or self.updated == self._last.step

    def wait_all(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job finished, casts included."""
        return self._last is None or self._last.finished.wait(timeout)

    def scale_after(self, step: int) -> float | None:
        """The loss scale after update ``step``'s decision, waiting for it (``None``: no update of that
        step decided one: not scaled, or it ended without deciding)."""
        self._decision(step).wait()
        return self.scales.get(step)

    def decide(self, step: int, scale: float | None) -> None:
        """Record update ``step``'s scale (``None``: none), for :meth:`scale_after`; also what a resumed
        run restores."""
        if scale is not None:
            self.scales[step] = scale
            self.scales.pop(step - 8, None)
        self._decision(step).set()
        with self._decided_lock:
            self._decided.pop(step - 8, None)

    def _decision(self, step: int) -> threading.Event:
        with self._decided_lock:
            return self._decided.setdefault(step, threading.Event())

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
            except PipelineAborted:
                stepped = sum(job.consumed[g].happened() for g in job.groups)
                if 0 < stepped < len(job.groups):
                    self.cut_short = (stepped, len(job.groups))
            except BaseException as e:
                self._on_error(e)
            finally:
                if not self._decision(job.step).is_set():  # no decision (not scaled, or cut short)
                    self.decide(job.step, None)
                job.math_done.set()
                job.finished.set()

    # ------------------------------------------------------------------ one update
    def _run(self, job: UpdateJob) -> None:
        groups = job.groups
        if (resident := self.resident) is not None:  # the device updates and casts its groups; a resumed cast
            groups = [g for g in job.groups if g not in resident.held]  # comes with its states
            if job.spec is not None:
                norm_of_rest = partial(self._norm, job, groups) if groups else None
                working, norm = resident.update(job, self.trace, norm_of_rest)
                if norm is not None:
                    self.grad_norms.append((job.step, norm))
                self.last_update = (job.step, working)
                if groups:  # the host's share, stepped as the device's gradients were
                    self._math(job, groups, norm, working)
            for g in resident.held.intersection(job.cast_done):
                job.cast_done[g].set()
            if not groups:
                self.updated = job.step
                return
        elif job.spec is not None:
            self._math(job)
        self.updated = job.step
        job.math_done.set()
        if not job.cast:
            return
        # double-buffered groups: step k + 2's copy was last read by step k, whose gradients the math
        # just used, so cast now; the others wait until step k + 1 no longer reads their one copy
        spare = [g for g in groups if self.store.groups[g].spare is not None and not job.cast_done[g].happened()]
        single = [g for g in groups if self.store.groups[g].spare is None]
        for g in spare:
            _wait_released(job, g)
            self._cast(job, g)
        if single:
            job.next_window.closed.wait()
        for g in single:
            for flight in job.next_window.flights:
                flight.wait_uploaded(g)
            self._cast(job, g)

    def _cast(self, job: UpdateJob, g: int, done: bool = False) -> None:
        """Cast update k into the copy step k + 2 reads (``done``: the one-pass kernel did)."""
        self.store.refresh_group(g, job.step + 2, copy=not done)
        job.cast_done[g].set()
        if self.trace is not None:
            self.trace.append(("cast", job.step, g, time.perf_counter()))

    def _norm(self, job: UpdateJob, groups: list[int]) -> float:
        """The 2-norm of ``groups``' host gradients, once they are complete."""
        for g in groups:
            job.wait_gradient(g)
        return math.sqrt(sum(float(torch.linalg.vector_norm(self._grad(g)).double()) ** 2 for g in groups))

    def _math(self, job: UpdateJob, groups: Any = None, given: float | None = None, done: float = 0.0) -> None:
        """The host's math of ``groups`` (default: the job's); with a share of the states on the device, the
        global norm it measured (``given``) and the seconds its update took (``done``) come along."""
        assert job.spec is not None
        groups = job.groups if groups is None else groups
        shadow = self._shadow(job.spec.optimizer)
        shadow.sync.apply(job.spec.hyperparameters)
        exchange = self.exchange
        if exchange is not None and not shadow.apart:
            raise RuntimeError(
                f"{type(shadow.optimizer).__name__}'s step couples its parameters (one step of all differs from"
                " steps of parts), and several nodes each update their own part: use an optimizer whose step"
                " treats each parameter alone (torch.optim's)"
            )
        clip_norm = job.spec.clip_value is not None and job.spec.clip_algorithm == "norm"
        coefficient = 1.0
        reduced: set[int] = set()

        def complete(g: int) -> None:
            if exchange is None:
                job.wait_gradient(g)
            else:  # (after an abort the other nodes' collectives may never come)
                job.grads_complete[g].wait()
            if exchange is not None and g not in reduced:
                exchange.reduce(g)  # in update order on every node: the collectives pair up
                reduced.add(g)

        norm = (clip_norm or job.spec.measure_norm) and given is None
        if clip_norm and given is not None:
            coefficient = min(1.0, job.spec.clip_value / (given + 1e-6))
        if norm or job.spec.scaler is not None or exchange is not None or not shadow.apart:
            for g in groups:  # the global norm (or one step of all) needs every gradient of the step (and
                complete(g)  # nodes reduce in order)
        working = done
        skip = False
        if job.spec.scaler is not None:
            start = time.perf_counter()
            skip = self._unscale(job)
            working += time.perf_counter() - start
        if norm and not skip:
            start = time.perf_counter()
            total = exchange.global_norm() if exchange is not None else self._norm(job, groups)  # (waits: done)
            self.grad_norms.append((job.step, total))
            if clip_norm:
                assert job.spec.clip_value is not None
                coefficient = min(1.0, job.spec.clip_value / (total + 1e-6))
            working += time.perf_counter() - start
        stepped = [g for g in groups if not (skip or (exchange is not None and not exchange.owns(g)))]
        for g in set(groups) - set(stepped):
            job.consumed[g].set()  # skipped, or another node updates this group (its gradient went there)
        for part in [[g] for g in stepped] if shadow.apart else [stepped]:
            for g in part:
                complete(g)
            start = time.perf_counter()
            for g in part:
                grad = self._grad(g)
                if job.spec.clip_value is not None and job.spec.clip_algorithm == "value":
                    grad.clamp_(-job.spec.clip_value, job.spec.clip_value)
                elif coefficient < 1.0:
                    grad.mul_(coefficient)
            self._step_groups(shadow, [g for g in part if not self._step_and_cast(shadow, job, g)])
            for g in part:
                job.consumed[g].set()
            end = time.perf_counter()
            working += end - start
            if self.trace is not None:
                self.trace.extend(("update", job.step, g, start, end) for g in part)
        if exchange is not None:
            exchange.broadcast_all(job.groups)  # every node's masters now hold the update
        self.last_update = (job.step, working)  # one assignment: a reader never pairs two steps

    def _unscale(self, job: UpdateJob) -> bool:
        """``16-mixed``: divide the step's gradients by the loss scale its batches used and decide as
        ``GradScaler.update`` does (the same two kernels): non-finite anywhere skips the whole update
        and multiplies the scale by ``backoff_factor``; ``growth_interval`` finite steps in a row
        multiply it by ``growth_factor``. Returns whether the update is skipped."""
        assert job.spec is not None and job.spec.scaler is not None
        scaler = job.spec.scaler
        found = torch.zeros(1)
        grads = [self._grad(g) for g in job.groups]
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, torch.full((1,), 1.0 / job.spec.loss_scale))
        torch._amp_update_scale_(
            scaler._scale, scaler._growth_tracker, found, scaler._growth_factor, scaler._backoff_factor,
            scaler._growth_interval,
        )  # fmt: skip
        self.decide(job.step, float(scaler._scale))
        return bool(found.item())

    def _grad(self, g: int) -> torch.Tensor:
        grad = self.store.groups[g].grad
        assert grad is not None
        return grad

    def _step_groups(self, shadow: Shadow, groups: list[int]) -> None:
        """Step only these groups' parameters: the shadow skips parameters whose gradient is ``None``."""
        stepped = []
        for g in groups:
            grad = self._grad(g)
            for p, offset in self.store.groups[g].params:
                sp = shadow.shadows_of.get(id(p))
                if sp is not None:
                    sp.grad = grad[offset : offset + p.numel()].view(p.shape)
                    stepped.append(sp)
        if stepped:
            shadow.optimizer.step()
        for sp in stepped:
            sp.grad = None

    def _step_and_cast(self, shadow: Shadow, job: UpdateJob, g: int) -> bool:
        """Update a double-buffered group and cast it into the copy step ``k + 2`` reads in one pass
        (:mod:`~lightning_roundpipe.runtime.one_pass`) where its optimizer and settings allow; whether it did."""
        group, out = self.store.groups[g], self.store.reads(g, job.step + 2)
        planned = job.one_pass and self.exchange is None and one_pass_items(group, shadow, self._grad(g), out)
        if not planned:
            return False
        released = _released(job, g)
        if not released:  # aborted, the copy perhaps still read: the kernel casts into a scratch copy instead, so
            scratch = torch.empty_like(out)  # the masters take the bits of a run without the failure
            if not (planned := one_pass_items(group, shadow, self._grad(g), scratch)):
                return False
        step_and_cast(*planned, shadow.optimizer)
        self.one_pass_groups += 1
        if released:  # (its gate, set here, keeps it out of the casts after the math; aborted, none is cast)
            self._cast(job, g, True)
        return True

    def _shadow(self, optimizer: torch.optim.Optimizer) -> Shadow:
        # rebuilt if the optimizer's state was replaced (load_state_dict) or groups were added
        key = (id(optimizer), id(optimizer.state), len(optimizer.param_groups))
        if key not in self._shadows:
            shadow, shadows_of = shadow_optimizer(optimizer)
            sync = GroupSync(optimizer, shadow)
            for (_, state, _), old in self._shadows.items():
                if old.sync.real is optimizer and state == id(optimizer.state):
                    sync.carry(old.sync)  # groups added (a loaded state starts from the loaded values)
            self._shadows = {key: Shadow(shadow, shadows_of, sync, steps_apart(optimizer) is True)}
        return self._shadows[key]

    def groups_to_host(self) -> None:
        """With no update running: what the steps changed in the shadow's groups, into the real ones."""
        for shadow in self._shadows.values():
            shadow.sync.to_host()


def _wait_released(job: UpdateJob, g: int) -> None:
    """Wait until step k no longer reads the copy update k is cast into (done before its last gradient, mostly)."""
    for flight in job.window.flights if job.window is not None else ():
        flight.wait_uploaded(g)


def _released(job: UpdateJob, g: int) -> bool:
    """:func:`_wait_released`; ``False`` after an abort."""
    try:
        _wait_released(job, g)
    except PipelineAborted:
        return False
    return True


@dataclass
class Shadow:
    """The user's optimizer as this thread steps it, and how."""

    optimizer: torch.optim.Optimizer
    shadows_of: dict[int, nn.Parameter]
    sync: GroupSync
    apart: bool
    """Whether its groups may be stepped one by one (:func:`~lightning_roundpipe.runtime.shadow.steps_apart`)."""
    _groups: dict[int, dict[str, Any]] | None = None

    def group_of(self, shadow_param: nn.Parameter) -> dict[str, Any] | None:
        """The shadow's parameter group that holds ``shadow_param``."""
        if self._groups is None:
            self._groups = {id(p): group for group in self.optimizer.param_groups for p in group["params"]}
        return self._groups.get(id(shadow_param))
