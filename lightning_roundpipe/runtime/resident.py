"""The optimizer on the device (``RoundPipeStrategy(optimizer_on="device")``): for models whose training states
fit on the one GPU beside the plan.

With the optimizer on the host, every step moves about 40 bytes a parameter through host memory (AdamW 28, the
cast 6, the gradients in and the weights out 6): on one H200 with the Qwen3-1.7B shape at 8 sequences a step that
bounded the step (SGD's lighter math ran 30,074 real tokens/s against AdamW's 24,005, 2026-12-04). Here, per trainable
group, the worker's device holds the fp32 master, its fp32 gradient, two compute copies (step ``k`` reads copy
``k % 2``) and the optimizer's states. Of them only the masters cross PCIe during training: each update's is
copied to the host's (4 bytes a parameter over the device-to-host link, which this mode leaves idle otherwise), so
that what reads the module's weights between steps (an EMA of the weights, a callback) sees them move as with the
host optimizer; the optimizer's states reach the host only at a flush.

The engine's order is kept exactly (staleness one; the edges of :mod:`~lightning_roundpipe.runtime.optimizer_worker`),
with the same host gates, each opened only once the device work behind it finished:

- a slot's gradients go into the group's device gradient (copied by the step's first write, added by later ones)
  on the gradients-down stream after the slot's compute; the collector opens the slot's gate once they are there;
- update ``k`` steps each group (deep first) once its gradient is complete (edge 3), then casts its master into
  copy ``k % 2``, which step ``k + 2`` reads (edge 2) and step ``k`` read last: its gradient being complete means
  step ``k`` is done with the group (edge 1); the thread waits for the device before opening the group's gates.

The host stays the checkpoint's and the user's view: :meth:`ResidentStates.to_host` (at every flush: checkpoints,
evaluation, teardown) writes the masters, the optimizer's states and the compute copy the next step reads back,
and :meth:`ResidentStates.from_host` takes them up again where something changed them there (a loaded checkpoint,
a user's edit: seen by the version counters, or :mod:`~lightning_roundpipe.runtime.edit_watch`'s samples).
"""

from __future__ import annotations

import collections
import copy
import math
import threading
import time
import warnings
from typing import Any

import torch
from torch import Tensor, nn

from lightning_roundpipe.runtime.callers import outside_package
from lightning_roundpipe.runtime.device import WorkerDevice
from lightning_roundpipe.runtime.edit_watch import HostSamples
from lightning_roundpipe.runtime.host_store import HostStore
from lightning_roundpipe.runtime.placement import STATE_BYTES, STATES_MOST, resident_bytes
from lightning_roundpipe.runtime.profile import TransferRate
from lightning_roundpipe.runtime.shadow import GroupSync, optimizer_over, steps_apart

EDITED = "roundpipe: the parameters or the optimizer's state changed on the host"
"""How the warning about an edit replaced by the device's values begins."""


class ResidentStates:
    """The trainable groups' training states on one worker device (see the module docstring)."""

    def __init__(
        self, store: HostStore, device: WorkerDevice, transfers: TransferRate | None = None, groups: Any = None
    ) -> None:
        self.store, self.device, self.transfers = store, device, transfers
        """``transfers``: the planner's upload rate, timed here (the slots upload none of these weights)."""
        self.groups = tuple(g.index for g in store.groups if g.trainable and (groups is None or g.index in groups))
        """The groups whose states are here (every trainable one, or the deepest share's); the host keeps the rest."""
        self.held = frozenset(self.groups)
        self.whole = len(self.groups) == sum(g.trainable for g in store.groups)
        self.master: dict[int, Tensor] = {}
        self.grad: dict[int, Tensor] = {}
        self.copies: dict[int, tuple[Tensor, Tensor]] = {}
        self.stream: Any = None
        self.optimizer: torch.optim.Optimizer | None = None  # the user's, which the shadow copies (and gets back)
        self._shadow: torch.optim.Optimizer | None = None
        self._params: dict[int, list[tuple[nn.Parameter, nn.Parameter, Tensor]]] = {}
        self._seen: tuple[Any, ...] | None = None  # what the host held when the device last matched it
        self._ahead = False  # updates the host has not seen
        self._viewing = threading.Lock()  # the optimizer thread's first update sets what the main thread compares
        self._mirror_stream: Any = None  # the masters' copies to the host after each update
        self._mirrored: dict[int, Any] = {}  # per group, the last of them
        self._samples = HostSamples(store, self.groups, device)  # edits the version counters do not show
        self._written: dict[int, Any] = {}  # per group, the gradients-down stream after its last gradient write
        self._room: dict[int, Tensor] = {}
        """Per group until its first update, its states' bytes held on the optimizer's stream: they come from this
        block (freed just before the group's first step), and a layer measured meanwhile does not count them."""
        self._key: tuple[Any, ...] | None = None  # the optimizer and its parameter groups the shadow mirrors
        self._sync: GroupSync | None = None  # the shadow's group values against the optimizer's
        self._apart = True  # whether its groups may be stepped one by one (shadow.steps_apart)
        self.need = resident_bytes(store, groups=self.held)

    def plan_limit(self, memory_limit: float | None) -> float | None:
        """What the plan's stages may use on the device beside these states (``None``: no limit)."""
        need = self.need
        if memory_limit is not None and need >= STATES_MOST * memory_limit:
            raise ValueError(
                f"optimizer_on='device' keeps {need / 2**30:.1f} GiB of training states on the device, too much of"
                f" the {memory_limit / 2**30:.1f} GiB it may use: use optimizer_on='host'"
            )
        return None if memory_limit is None else memory_limit - need

    def reads(self, g: int, step: int) -> Tensor:
        """The compute copy training step ``step`` reads on the device."""
        return self.copies[g][step % 2]

    # ------------------------------------------------------------------ gradients (a worker's thread)
    def write_gradient(self, g: int, grad: Tensor | None, overwrite: bool) -> None:
        """On the current stream: a slot's gradient into the group's (``None``: none reached it)."""
        if grad is None:
            if overwrite:
                self.grad[g].zero_()
        elif overwrite:
            self.grad[g].copy_(grad)
        else:
            self.grad[g].add_(grad)

    def written(self, groups: Any, event: Any) -> None:
        """After the gradients-down stream's writes into ``groups`` (``event``): an update of one waits for it on
        the device too. The host's gates already order the writes they count; a batch run again after running out
        of memory counts its queued writes as landed without a gate of its own."""
        for g in groups:
            self._written[g] = event

    # ------------------------------------------------------------------ updates (the optimizer thread)
    def update(
        self, job: Any, trace: list[tuple[Any, ...]] | None = None, norm_of_rest: Any = None
    ) -> tuple[float, float | None]:
        """Update ``job.step``'s groups held here in its order, then cast each master into copy ``job.step % 2``.
        Returns the seconds the device work took as the host waited for it, and the gradients' global 2-norm
        before clipping where asked (else ``None``); ``norm_of_rest()``: that of the groups the host keeps."""
        spec = job.spec
        self._ahead = True  # from here the device's values lead the host's (a failure midway included)
        with self.device.on(self.stream):
            self._use(spec.optimizer)
        assert self._shadow is not None and self._sync is not None
        if not (self._apart or self.whole):
            raise RuntimeError(
                f"{type(spec.optimizer).__name__}'s step couples its parameters, and a share of the states on the"
                " device steps them apart from the host's: use optimizer_on='host' or 'device'"
            )
        self._sync.apply(spec.hyperparameters)
        dev, working, coefficient, total = self.device, 0.0, 1.0, None
        groups = [g for g in job.groups if g in self.held]
        clip_norm = spec.clip_value is not None and spec.clip_algorithm == "norm"
        if clip_norm or spec.measure_norm or not self._apart:  # (one step of all waits for all gradients too)
            for g in groups:
                job.wait_gradient(g)
            start = time.perf_counter()
            with dev.on(self.stream):
                norms = torch.stack([torch.linalg.vector_norm(self.grad[g].float()) for g in groups])
                total = float(torch.linalg.vector_norm(norms.double()))
            working += time.perf_counter() - start
            if norm_of_rest is not None:
                total = math.sqrt(total**2 + norm_of_rest() ** 2)
            if clip_norm:
                coefficient = min(1.0, spec.clip_value / (total + 1e-6))
        for part in [[g] for g in groups] if self._apart else [groups]:
            for g in part:
                job.wait_gradient(g)  # edge 3: the collector saw the slot's writes complete
            start = time.perf_counter()
            with dev.on(self.stream):
                for g in part:
                    if g in self._mirrored:  # the host's copy of the last update has been read out of the master
                        dev.wait(self.stream, self._mirrored[g])
                    if g in self._written:  # the gradient's last write (edge 3 on the device)
                        dev.wait(self.stream, self._written[g])
                    if spec.clip_value is not None and spec.clip_algorithm == "value":
                        self.grad[g].clamp_(-spec.clip_value, spec.clip_value)
                    elif coefficient < 1.0:
                        self.grad[g].mul_(coefficient)
                    self._room.pop(g, None)  # its states come from this block, back in this stream's cache
                self._step_groups(part)
                for g in part:
                    self.copies[g][job.step % 2].copy_(self.master[g])  # what step k + 2 reads (edges 1 and 2)
            done = dev.record(self.stream)
            for g in part:
                self._mirror(g, done)
            dev.host_wait(done)
            for g in part:
                job.consumed[g].set()  # edge 4: the next step's first write may overwrite the gradient
                job.cast_done[g].set()
            end = time.perf_counter()
            working += end - start
            if trace is not None:
                trace.extend(("update", job.step, g, start, end) for g in part)
        return working, total

    def _mirror(self, g: int, updated: Any) -> None:
        """The updated master into the host's (the module's weights), on a stream of its own, after ``updated``:
        what a callback reads during training (an EMA of the weights) moves as with the host optimizer, one
        step behind at most, for 4 bytes a parameter over the otherwise idle device-to-host link."""
        dev, index = self.device, self.groups.index(g)
        dev.wait(self._mirror_stream, updated)
        self._samples.before_copy(g, self._mirrored.get(g))
        with self._viewing, dev.on(self._mirror_stream):  # the copy's version bump is ours, not a user's edit
            group = self.store.groups[g]
            ours = self._seen is not None and self._seen[0][index] == group.version()
            group.data.copy_(self.master[g], non_blocking=True)
            self._samples.copy(g, self.master[g])
            if ours:
                versions = list(self._seen[0])
                versions[index] = group.version()
                self._seen = (tuple(versions), self._seen[1])
            self._mirrored[g] = dev.record(self._mirror_stream)

    def _after_mirrors(self) -> None:
        """On the states' stream: the host copies in flight finished (before it reads or writes the host's)."""
        for event in list(self._mirrored.values()):
            self.device.wait(self.stream, event)

    def _step_groups(self, groups: list[int]) -> None:
        assert self._shadow is not None
        pairs = [pair for g in groups for pair in self._params[g]]
        for _, sp, grad in pairs:
            sp.grad = grad
        self._shadow.step()
        for _, sp, _ in pairs:
            sp.grad = None

    def _use(self, optimizer: torch.optim.Optimizer) -> None:
        """The shadow of ``optimizer`` over the device masters: built at the first update (its states taken from
        the host), again with the device's states when parameter groups were added, and from the host's states
        when the optimizer itself is another one."""
        key = (id(optimizer), tuple(tuple(map(id, group["params"])) for group in optimizer.param_groups))
        if key == self._key:
            return
        carried: dict[int, dict[str, Any]] = {}
        if self._shadow is not None and self.optimizer is optimizer:
            carried = {id(p): self._shadow.state[sp] for p, sp, _ in self._pairs() if sp in self._shadow.state}
        of: dict[int, nn.Parameter] = {}
        params = {}  # assigned whole: the main thread's look at the host reads it
        for group in self.store.groups:
            if group.index in self.held:
                pairs = []
                for p, offset in group.params:
                    span = slice(offset, offset + p.numel())
                    sp = nn.Parameter(self.master[group.index][span].view(p.shape), requires_grad=p.requires_grad)
                    of[id(p)] = sp
                    pairs.append((p, sp, self.grad[group.index][span].view(p.shape)))
                params[group.index] = pairs
        self._params = params
        shadow = optimizer_over(optimizer, of, collections.defaultdict(dict))
        sync = GroupSync(optimizer, shadow)
        if self._sync is not None and self.optimizer is optimizer:
            sync.carry(self._sync)  # groups added: what the steps kept in the groups carries over
        self._shadow, self._key, self._sync = shadow, key, sync
        self._apart = steps_apart(optimizer) is True
        if self.optimizer is optimizer:
            for p, sp, _ in self._pairs():
                if id(p) in carried:
                    shadow.state[sp] = carried[id(p)]
            return
        with self._viewing:  # the main thread's look at the host never sees the optimizer without its states' view
            seen, self.optimizer = self._seen, optimizer
            _states_from_host(self._shadow, self.optimizer, self._pairs(), self.device.device)
            if seen is not None:  # the states just taken are what the host holds
                self._seen = (seen[0], _state_view(optimizer, self._pairs()))

    def _pairs(self) -> list[tuple[nn.Parameter, nn.Parameter, Tensor]]:
        """(parameter, its shadow on the device, its device gradient) of every trainable parameter."""
        return [pair for pairs in self._params.values() for pair in pairs]

    # ------------------------------------------------------------------ the host's view
    def from_host(self, step: int) -> bool:
        """Before a training batch of ``step``: whether it took the masters, states and compute copies from the
        host, which changed them since the device last matched it (the first batch, a loaded checkpoint, an edit)."""
        if not self.host_changed():
            return False
        dev = self.device
        if not self.master:
            self.stream, self._mirror_stream = dev.new_stream(), dev.new_stream()
            for g in self.groups:
                group = self.store.groups[g]
                self.master[g] = dev.empty(group.data.numel(), group.data.dtype, self.stream)
                self.grad[g] = dev.empty(group.data.numel(), group.data.dtype, self.stream)
                copies = tuple(dev.empty(group.compute.numel(), group.compute.dtype, self.stream) for _ in range(2))
                self.copies[g] = (copies[0], copies[1])
                with dev.on(self.stream):
                    self.grad[g].zero_()  # (later, a step's first write overwrites: a flush mid-step keeps its sum)
                if self._shadow is None:
                    self._room[g] = dev.empty(STATE_BYTES * group.data.numel(), torch.uint8, self.stream)
        with dev.on(self.stream):
            self._after_mirrors()
            start = dev.timer(self.stream)
            for g in self.groups:  # what step ``step`` reads (staleness one), from pinned host memory
                self.reads(g, step).copy_(self.store.reads(g, step), non_blocking=True)
            end = dev.timer(self.stream)
            for g in self.groups:
                self.master[g].copy_(self.store.groups[g].data)
                self.reads(g, step + 1).copy_(self.master[g])  # the masters hold every update before ``step``
            if self._shadow is not None and self._sync is not None:
                _states_from_host(self._shadow, self.optimizer, self._pairs(), self.device.device)
                self._sync.from_host()
        dev.host_wait(dev.record(self.stream))
        if self.transfers is not None:
            self.transfers.timed(sum(self.reads(g, step).nbytes for g in self.groups), dev.elapsed(start, end))
        self._seen = self._host_view()
        self._samples.take()
        return True

    def host_changed(self) -> bool:
        """Whether the host holds masters or states the device has not taken (always before the first batch)."""
        with self._viewing:  # (the samples: edits through p.data, which move no version counter)
            return self._samples.edited or self._host_view() != self._seen or self._samples.look(self._mirrored)

    def edited(self) -> bool:
        """Whether the host's masters or states changed since the device's updates began leading them: a user's
        edit during training (a callback clipping or masking the weights), which the next flush replaces."""
        return self._ahead and bool(self.master) and self.host_changed()

    def to_host(self, step: int) -> None:
        """After a flush: the masters, the optimizer's states and the copy step ``step`` reads, on the host."""
        if not self._ahead or not self.master:
            return  # nothing the device changed since it matched the host
        if self.host_changed():
            warnings.warn(
                EDITED + " during training with"
                " optimizer_on='device' (what 'auto' picks where they fit on the one GPU); the device's values,"
                " updated since, replace them. Edit them after a checkpoint or validation, which bring the device's"
                " values to the host, or pass RoundPipeStrategy(optimizer_on='host') to keep edits made between"
                " steps (weight clipping, pruning masks), as plain training does",
                stacklevel=outside_package(),
            )
        dev = self.device
        with dev.on(self.stream):
            self._after_mirrors()
            for g in self.groups:
                self.store.groups[g].data.copy_(self.master[g])
                self.store.reads(g, step).copy_(self.reads(g, step))
        if self._shadow is not None and self.optimizer is not None:
            state, shadow = self.optimizer.state, self._shadow.state
            for p, sp, _ in self._pairs():  # into the last flush's host tensors, in place
                if sp in shadow:
                    state[p] = {k: _into(state.get(p, {}).get(k), v) for k, v in shadow[sp].items()}
            if self._sync is not None:
                self._sync.to_host()
        dev.host_wait(dev.record(self.stream))
        self._seen, self._ahead = self._host_view(), False
        self._samples.take()

    def _host_view(self) -> tuple[Any, ...]:
        """What the host holds, cheaply: the masters' version counters and the optimizer's state dict."""
        return (tuple(self.store.groups[g].version() for g in self.groups), _state_view(self.optimizer, self._pairs()))

    def rescue(self, step: int) -> None:
        """At the close after a failure, once no thread runs: the device's values to the host if it still
        answers (the host path's masters hold every update applied so far; so do these then), else a warning."""
        try:
            self.to_host(step)
        except Exception as e:  # a device that failed for good: say what the module holds
            warnings.warn(
                f"roundpipe: after the failure the device's weights and optimizer states could not be brought back"
                f" to the host ({e!r}); the module holds those of the last checkpoint, validation or flush",
                stacklevel=outside_package(),
            )


def _states_from_host(shadow: Any, optimizer: Any, pairs: list[Any], device: torch.device) -> None:
    """The host's optimizer states of the held parameters into the shadow's, on ``device``."""
    on_device = {  # torch keeps a step count on the device only for its fused and capturable kernels
        id(sp): bool(group.get("fused") or group.get("capturable"))
        for group in shadow.param_groups
        for sp in group["params"]
    }
    shadow.state.clear()
    for p, sp, _ in pairs:
        saved = optimizer.state.get(p)
        if saved:
            where = {k: device if k != "step" or on_device[id(sp)] else torch.device("cpu") for k in saved}
            shadow.state[sp] = {k: _to(v, where[k]) for k, v in saved.items()}


def _state_view(optimizer: torch.optim.Optimizer | None, pairs: list[Any]) -> tuple[int, int, int] | None:
    """The state dict, the held parameters' entries and their tensors' version counters (an in-place edit moves
    one; the host's own steps of the groups it keeps move theirs, which are not looked at)."""
    if optimizer is None:
        return None
    marks, entries, state = 0, 0, optimizer.state
    for p, _, _ in pairs:
        if (entry := state.get(p)) is None:
            continue
        entries, marks = entries + 1, marks + id(entry)
        for value in entry.values() if isinstance(entry, dict) else ():
            if isinstance(value, Tensor):
                marks += id(value) + value._version
    return (id(state), entries, marks)


def _into(held: Any, value: Any) -> Any:
    """``value`` on the host: copied into ``held`` where that is a host tensor of its shape and dtype (each flush
    of a 1.7B model's states would otherwise fault in about 14 GB of new pageable memory), else a new copy."""
    if (
        isinstance(held, Tensor) and isinstance(value, Tensor) and held.device.type == "cpu"
        and held.shape == value.shape and held.dtype == value.dtype and held.data_ptr() != value.data_ptr()
    ):  # fmt: skip
        return held.copy_(value)
    return _to(value, torch.device("cpu"))


def _to(value: Any, device: torch.device) -> Any:
    """A state entry copied to ``device`` (never shared between host and device, even on the CPU stand-in)."""
    return value.to(device, copy=True) if isinstance(value, Tensor) else copy.deepcopy(value)
