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

The user's optimizer is driven through a *shadow*: the same class and per-parameter state dicts, but
its own parameter objects (sharing storage with the real ones) and its own ``param_groups`` loaded
from the hyper-parameters captured at submission. So Lightning's ``zero_grad`` and LR schedulers on
the main thread never race the worker; checkpoints read the real optimizer's (shared) state.
"""

from __future__ import annotations

import collections
import copy
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_roundpipe.runtime.exchange import NodeExchange
from lightning_roundpipe.runtime.host_store import HostStore
from lightning_roundpipe.runtime.workers import Gate, PipelineAborted

if TYPE_CHECKING:
    from lightning_roundpipe.runtime.resident import ResidentStates


@dataclass
class UpdateSpec:
    """What the strategy captures on the main thread when it submits a step."""

    optimizer: torch.optim.Optimizer
    hyperparameters: list[dict[str, Any]]
    """Per parameter group, everything but ``params`` (LR and friends as of submission)."""
    clip_value: float | None = None
    clip_algorithm: str = "norm"
    measure_norm: bool = False
    """Compute the gradients' global 2-norm (before clipping) even when not clipping by norm."""
    scaler: torch.amp.GradScaler | None = None
    """``precision="16-mixed"``: the scaler whose scale and growth tracker this update advances."""
    loss_scale: float = 1.0
    """The loss scale the step's batches multiplied their loss by (what its gradients are divided by)."""

    @classmethod
    def capture(
        cls,
        optimizer: Any,
        clip_value: float | None = None,
        clip_algorithm: str = "norm",
        measure_norm: bool = False,
        scaler: torch.amp.GradScaler | None = None,
        loss_scale: float = 1.0,
    ) -> UpdateSpec:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # unwrap Lightning's LightningOptimizer
        hyper = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        return cls(
            optimizer, hyper, clip_value or None, str(clip_algorithm or "norm"), measure_norm, scaler, loss_scale
        )


class StepWindow:
    """The flights of one optimizer step, known completely once the window is closed."""

    def __init__(self, abort: threading.Event) -> None:
        self.flights: list[Any] = []
        self.closed = Gate(abort)


@dataclass
class UpdateJob:
    step: int
    spec: UpdateSpec | None
    """``None``: no math, only the cast (a resumed run's pending cast of the update saved with it)."""
    groups: tuple[int, ...]
    """Trainable groups in update order (deep layers first: the order the next backward needs them)."""
    grads_complete: dict[int, Gate]
    consumed: dict[int, Gate]
    cast_done: dict[int, Gate]
    next_window: StepWindow
    cast: bool = True
    """``False``: the engine casts this update itself at the next step's barrier (the blocking variant)."""
    window: StepWindow | None = None
    """This step's batches (``None``: none, e.g. a resumed run's pending cast): with double buffering,
    the last ones to read the compute copy the cast overwrites."""
    math_done: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)


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
        self._shadows: dict[tuple[int, ...], tuple[torch.optim.Optimizer, dict[int, nn.Parameter]]] = {}
        self.grad_norms: collections.deque[tuple[int, float]] = collections.deque(maxlen=256)
        """(step, global 2-norm of its gradients before clipping) of the recent updates that computed it."""
        self.scales: dict[int, float] = {}
        """``16-mixed``: per update, the loss scale after its decision (halved after non-finite gradients,
        grown after ``growth_interval`` finite steps), as :meth:`scale_after` hands it to later steps."""
        self._decided: dict[int, threading.Event] = {}
        self._decided_lock = threading.Lock()
        self.last_update: tuple[int, float] | None = None
        """The last update's step and the host seconds its math took (clipping and the optimizer's steps; not
        the waits for gradients, nor the casts): what the devices' step must be longer than for it to hide."""
        self.resident: ResidentStates | None = None
        """``optimizer_on="device"``: the states the updates run on (none of this thread's host math or casts)."""
        self._thread = threading.Thread(target=self._loop, name="roundpipe-optimizer", daemon=True)
        self._thread.start()

    def submit(self, job: UpdateJob) -> None:
        self._last = job
        self._jobs.put(job)

    def wait_math(self) -> None:
        """Wait until every submitted update changed the masters (casts may still be pending)."""
        if self._last is not None:
            self._last.math_done.wait()

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
                pass
            except BaseException as e:
                self._on_error(e)
            finally:
                if not self._decision(job.step).is_set():  # no decision (not scaled, or cut short)
                    self.decide(job.step, None)
                job.math_done.set()
                job.finished.set()

    # ------------------------------------------------------------------ one update
    def _run(self, job: UpdateJob) -> None:
        if self.resident is not None:  # the device updates and casts; a resumed cast comes with its states
            if job.spec is not None:
                working, norm = self.resident.update(job, self.trace)
                if norm is not None:
                    self.grad_norms.append((job.step, norm))
                self.last_update = (job.step, working)
            for gate in job.cast_done.values():
                gate.set()
            return
        if job.spec is not None:
            self._math(job)
        job.math_done.set()
        if not job.cast:
            return
        # double-buffered groups: step k + 2's copy was last read by step k, whose gradients the math
        # just used, so cast now; the others wait until step k + 1 no longer reads their one copy
        spare = [g for g in job.groups if self.store.groups[g].spare is not None]
        single = [g for g in job.groups if self.store.groups[g].spare is None]
        for g in spare:
            for flight in job.window.flights if job.window is not None else ():
                flight.wait_uploaded(g)
            self._cast(job, g)
        if single:
            job.next_window.closed.wait()
        for g in single:
            for flight in job.next_window.flights:
                flight.wait_uploaded(g)
            self._cast(job, g)

    def _cast(self, job: UpdateJob, g: int) -> None:
        self.store.refresh_group(g, job.step + 2)
        job.cast_done[g].set()
        if self.trace is not None:
            self.trace.append(("cast", job.step, g, time.perf_counter()))

    def _math(self, job: UpdateJob) -> None:
        assert job.spec is not None
        shadow, shadows_of = self._shadow(job.spec.optimizer)
        for group, hyper in zip(shadow.param_groups, job.spec.hyperparameters):
            group.update(hyper)
        exchange = self.exchange
        clip_norm = job.spec.clip_value is not None and job.spec.clip_algorithm == "norm"
        coefficient = 1.0
        reduced: set[int] = set()

        def complete(g: int) -> None:
            job.grads_complete[g].wait()
            if exchange is not None and g not in reduced:
                exchange.reduce(g)  # in update order on every node: the collectives pair up
                reduced.add(g)

        norm = clip_norm or job.spec.measure_norm
        if norm or job.spec.scaler is not None or exchange is not None:
            for g in job.groups:  # the global norm needs every gradient of the step (and nodes reduce in order)
                complete(g)
        working = 0.0
        skip = False
        if job.spec.scaler is not None:
            start = time.perf_counter()
            skip = self._unscale(job)
            working += time.perf_counter() - start
        if norm and not skip:
            start = time.perf_counter()
            if exchange is not None:
                total = exchange.global_norm()
            else:
                total = math.sqrt(sum(float(torch.linalg.vector_norm(self._grad(g)).double()) ** 2 for g in job.groups))
            self.grad_norms.append((job.step, total))
            if clip_norm:
                assert job.spec.clip_value is not None
                coefficient = min(1.0, job.spec.clip_value / (total + 1e-6))
            working += time.perf_counter() - start
        for g in job.groups:
            complete(g)
            if skip or (exchange is not None and not exchange.owns(g)):
                job.consumed[g].set()  # skipped, or another node updates this group (its gradient went there)
                continue
            start = time.perf_counter()
            grad = self._grad(g)
            if job.spec.clip_value is not None and job.spec.clip_algorithm == "value":
                grad.clamp_(-job.spec.clip_value, job.spec.clip_value)
            elif coefficient < 1.0:
                grad.mul_(coefficient)
            self._step_group(shadow, shadows_of, g)
            job.consumed[g].set()
            end = time.perf_counter()
            working += end - start
            if self.trace is not None:
                self.trace.append(("update", job.step, g, start, end))
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

    def _step_group(self, shadow: torch.optim.Optimizer, shadows_of: dict[int, nn.Parameter], g: int) -> None:
        """Step only this group's parameters: the shadow skips parameters whose gradient is ``None``."""
        group = self.store.groups[g]
        grad = self._grad(g)
        stepped = []
        for p, offset in group.params:
            sp = shadows_of.get(id(p))
            if sp is not None:
                sp.grad = grad[offset : offset + p.numel()].view(p.shape)
                stepped.append(sp)
        if stepped:
            shadow.step()
        for sp in stepped:
            sp.grad = None

    def _shadow(self, optimizer: torch.optim.Optimizer) -> tuple[torch.optim.Optimizer, dict[int, nn.Parameter]]:
        # rebuilt if the optimizer's state was replaced (load_state_dict) or groups were added
        key = (id(optimizer), id(optimizer.state), len(optimizer.param_groups))
        if key not in self._shadows:
            self._shadows = {key: shadow_optimizer(optimizer)}
        return self._shadows[key]


class _SharedState(dict):
    """The shadow's per-parameter state: the real optimizer's own dicts, looked up on first use only (so
    parameters the shadow never steps, such as frozen ones, get no state entry at all)."""

    def __init__(self, real_state: dict[Any, Any], real_of: dict[int, nn.Parameter]) -> None:
        super().__init__()
        self._real_state = real_state
        self._real_of = real_of

    def __missing__(self, shadow_param: Any) -> dict[str, Any]:
        state = self._real_state[self._real_of[id(shadow_param)]]
        self[shadow_param] = state
        return state


def shadow_optimizer(optimizer: torch.optim.Optimizer) -> tuple[torch.optim.Optimizer, dict[int, nn.Parameter]]:
    """A copy of ``optimizer`` over new parameter objects that share storage and per-parameter state.

    Returns the shadow and a map from ``id(real parameter)`` to its shadow parameter.
    """
    shadows_of: dict[int, nn.Parameter] = {}
    real_of: dict[int, nn.Parameter] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in shadows_of:
                sp = nn.Parameter(p.detach(), requires_grad=p.requires_grad)
                shadows_of[id(p)] = sp
                real_of[id(sp)] = p
    return optimizer_over(optimizer, shadows_of, _SharedState(optimizer.state, real_of)), shadows_of


def optimizer_over(optimizer: torch.optim.Optimizer, shadows_of: dict[int, nn.Parameter], state: Any) -> Any:
    """``optimizer``'s class, hyper-parameters and hooks over the parameters ``shadows_of`` maps the real ones to (by
    ``id``; those it does not map are left out), with ``state`` as its per-parameter state."""
    # Every attribute, not only the three torch pickles (what ``copy.copy`` keeps): bitsandbytes' optimizers and
    # others read their own settings from the instance in ``step``.
    shadow = object.__new__(type(optimizer))
    shadow.__dict__.update(optimizer.__dict__)
    # An LR scheduler wraps ``optimizer.step`` in an instance attribute bound to the real optimizer:
    # the shadow must call its class's own step.
    shadow.__dict__.pop("step", None)
    for hooks in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):  # the user's hooks are the real
        if hooks in shadow.__dict__:  # step's, not each group's
            setattr(shadow, hooks, collections.OrderedDict())
    shadow.param_groups = [
        {**group, "params": [shadows_of[id(p)] for p in group["params"] if id(p) in shadows_of]}
        for group in optimizer.param_groups
    ]
    shadow.state = state
    return shadow
