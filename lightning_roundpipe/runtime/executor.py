"""Stage executor: what one worker does for each action of a schedule, on its own device.

Each worker owns weight-less replicas of the layers (module skeletons whose tensors are on the meta
device) and runs them with :func:`torch.func.functional_call` on the stage's device copy of the
weights: two workers never touch the same module object, and none touches the master tensors.

Every action only *issues* device work. Inputs arrive as parcels (host tensors plus the event after
which they are valid); each compute action uploads its inputs on the activations-up stream, computes
on the compute stream, and downloads its outputs on the activations-down stream, each step waiting
for the previous one's event. Weight uploads and gradient downloads run on their own streams in the
parts the schedule placed between compute actions. The thread stays at most ``max_inflight``
micro-batches ahead of its device, which bounds device memory.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_roundpipe.runtime.collector import GradCollector, GradJob
from lightning_roundpipe.runtime.device import WorkerDevice, layer_seed
from lightning_roundpipe.runtime.flight import Flight
from lightning_roundpipe.runtime.host_pool import HostMemoryError, Parcel
from lightning_roundpipe.runtime.host_store import HostStore
from lightning_roundpipe.runtime.workers import Gate, PipelineAborted
from lightning_roundpipe.schedule.actions import Action, Op
from lightning_roundpipe.schedule.plan import Stage, StagePlan
from lightning_roundpipe.schedule.transfers import pack_parts

_PLAIN = (bool, int, float, str, type(None))
MEASURING_NOTE = (
    "roundpipe: this was a batch that measures the layers (plan='auto' runs profile_steps of them, with one"
    " layer per stage). It keeps every layer's input on the host until backward; the plan that follows"
    " keeps only its backward stages' inputs, often far fewer. A plan passed to RoundPipeStrategy skips"
    " this measurement; RoundPipeMonitor(layer_costs=...) prints the automatic plan of a run."
)


def weightless_replica(layer: nn.Module) -> nn.Module:
    """A deep copy of ``layer`` whose parameters and buffers are meta tensors (no memory, no data)."""
    memo: dict[int, Any] = {}
    for p in layer.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in layer.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(layer, memo)


def plain_attributes(layers: Sequence[nn.Module]) -> list[list[dict[str, Any]]]:
    """Every submodule's plain attributes (``training``, ``p`` of a dropout, flags a user flips mid-run).

    Taken on the main thread at each batch and applied to the replicas, so that what users change on
    their modules between steps reaches the workers. Tensors travel through the host store instead.
    """
    return [[{k: v for k, v in m.__dict__.items() if type(v) in _PLAIN} for m in layer.modules()] for layer in layers]


@dataclass
class _Loaded:
    """A slot's weights on this worker, from upload to unload."""

    flats: dict[int, Tensor]
    ready: Any = None
    """Event after the last upload part; compute waits for it once."""
    tensors: dict[int, dict[str, Tensor]] | None = None
    """Per layer, the named tensors handed to ``functional_call``; built at the slot's first compute."""
    grads: dict[int, Tensor] = field(default_factory=dict)
    """Flat gradient buffers of the trainable groups: every parameter's ``.grad`` is a view into one."""
    backward_ran: bool = False
    last_compute: Any = None
    downloads: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)
    """Per group, (device source, host destination) of the gradient download."""
    staging: dict[int, Tensor] = field(default_factory=dict)
    summed_here: set[int] = field(default_factory=set)
    """Groups whose host partial sum comes up to be added on this device (see ``_add_on_device``)."""


class StageExecutor:
    """Runs the actions of one worker against a flight."""

    def __init__(
        self,
        device: WorkerDevice,
        store: HostStore,
        layers: Sequence[nn.Module],
        plan: StagePlan,
        base_seed: int,
        autocast_dtype: torch.dtype | None,
        collector: GradCollector,
        on_error: Callable[[BaseException], None],
        overlap: str = "priority",
        max_inflight: int = 2,
    ) -> None:
        self.device = device
        self.store = store
        self.plan = plan
        self.base_seed = base_seed
        self.autocast_dtype = autocast_dtype
        self.collector = collector
        self.overlap = overlap
        self.max_inflight = max_inflight
        self.replicas = [weightless_replica(layer) for layer in layers]
        self._slots_of = [_tensor_slots(replica, refs) for replica, refs in zip(self.replicas, store.layer_tensors)]
        self._on_error = on_error
        self._tables: dict[StagePlan, tuple[Any, ...]] = {}
        self._use_plan(plan)
        self._loaded: dict[tuple[int, int], _Loaded] = {}
        self._inflight: deque[Any] = deque()
        self._collecting: list[Gate] = []
        self._tail: tuple[int, int] | None = None
        """The slot whose gradients a settling batch downloads last on this worker: no compute follows
        it to hide a host add, so its later writes are summed on the device instead."""
        self.trace: list[tuple[Any, ...]] | None = None
        """When a list: (\"action\", worker, batch, action, start time) is appended for every action."""

    def _use_plan(self, plan: StagePlan) -> None:
        """Stage tables of ``plan`` (cached): the plan may change between batches."""
        if plan not in self._tables:
            stages = plan.stages()
            groups = {s.slot: self.store.groups_of(s.layers) for s in stages}
            trainable = {k: tuple(g for g in gs if self.store.groups[g].trainable) for k, gs in groups.items()}
            self._tables[plan] = (stages, set(plan.saved_boundaries()), groups, trainable, {})
        self.plan = plan
        self._stages, self._saved, self._groups, self._trainable, self._pieces = self._tables[plan]

    def _out_of_memory_note(self, action: Action) -> str:
        """What ran out, and what to change: the stage's layers, the device's memory, the knobs."""
        stage = self._stages[action.slot]
        where = f"stage {action.slot} ({stage.kind.name.lower()}, layers {stage.start}-{stage.stop - 1})"
        memory = ""
        if self.device.device.type == "cuda":
            allocated = torch.cuda.memory_allocated(self.device.device) / 2**30
            reserved = torch.cuda.memory_reserved(self.device.device) / 2**30
            memory = (
                f" on {self.device.device}: {allocated:.2f} GiB allocated, {reserved - allocated:.2f} GiB reserved"
                " by PyTorch but unallocated (fragmentation)"
            )
        return (
            f"roundpipe: {where} ran out of memory{memory}. Lower RoundPipeStrategy(gpu_memory=...) so the"
            " automatic plan makes smaller stages, or pass a plan with smaller stages; use more micro-batches"
            " (num_microbatches) or a smaller batch or shorter sequences. docs/tuning.md has more."
        )

    # ------------------------------------------------------------------ one batch
    def run(
        self, actions: Sequence[Action], flight: Flight, attributes: list[list[dict[str, Any]]], settle: bool = True
    ) -> None:
        """Run one batch's actions in order; with ``settle``, also wait until their effects landed on the
        host (the synchronous mode; the asynchronous one goes straight on to the next batch)."""
        for replica, layer_attributes in zip(self.replicas, attributes):
            for module, values in zip(replica.modules(), layer_attributes):
                module.__dict__.update(values)
        self._use_plan(flight.schedule.plan)
        self._tail = None
        if settle and self.add_tail_on_device and not flight.evaluating:
            self._tail = tail_slot(actions, self._downloads_gradients)
        if flight.record:
            flight.references[self.device.index] = (self.device.timer(self.device.compute), time.perf_counter())
        try:
            for action in actions:
                if flight.abort.is_set():
                    raise PipelineAborted
                try:
                    self._run(action, flight)
                except PipelineAborted:
                    raise
                except BaseException as e:
                    if hasattr(e, "add_note"):
                        e.add_note(f"(raised by roundpipe worker {self.device.index} running action {action})")
                        if isinstance(e, torch.OutOfMemoryError):
                            e.add_note(self._out_of_memory_note(action))
                        if isinstance(e, HostMemoryError) and flight.measure_memory:
                            e.add_note(MEASURING_NOTE)
                    raise
            if settle:
                for gate in self._collecting:
                    gate.wait()
        except PipelineAborted:
            settle = True
            raise
        except BaseException as e:
            settle = True
            self._on_error(e)  # abort the others now, before waiting for the collector below
            raise
        finally:
            if settle:
                self.collector.drain()
                self.device.synchronize()
                self._inflight.clear()
                for loaded in self._loaded.values():  # an aborted slot's gradients never reached the collector
                    for buffer in loaded.staging.values():
                        self.device.pool.give(buffer)
            self._loaded.clear()
            self._collecting.clear()

    def _downloads_gradients(self, slot: int) -> bool:
        return self._stages[slot].has_gradients and bool(self._trainable[slot])

    def _run(self, action: Action, flight: Flight) -> None:
        stage = self._stages[action.slot]
        if self.trace is not None:
            self.trace.append(("action", self.device.index, flight.call, str(action), time.perf_counter()))
        if action.op is Op.LOAD:
            self._load(stage, action, flight)
        elif action.op is Op.UNLOAD:
            self._unload(stage, action, flight)
        elif action.op is Op.FORWARD:
            self._forward(stage, action, flight)
        elif flight.evaluating:
            self._evaluate(stage, action, flight)
        else:
            self._backward(stage, action, flight)

    # ------------------------------------------------------------------ weights and gradients
    def _parts(self, slot: int, what: str, parts: int) -> list[list[tuple[int, int, int]]]:
        key = (slot, what, parts)
        if key not in self._pieces:
            groups = self._groups[slot] if what == "W" else self._trainable[slot]
            sizes = [
                (g, self.store.groups[g].compute.numel(), self.store.groups[g].compute.element_size()) for g in groups
            ]
            self._pieces[key] = pack_parts(sizes, parts)
        return self._pieces[key]

    def _load(self, stage: Stage, action: Action, flight: Flight) -> None:
        dev = self.device
        key = (action.round, action.slot)
        handoff = flight.record and key == (0, 0)  # measured for the simulator's handoff between batches
        if action.is_first_part:
            waiting = time.perf_counter() if handoff else 0.0
            for g in self._trainable[stage.slot]:  # edge 2: the copy this step must read is in place
                gate = flight.upload_waits.get(g)
                if gate is not None:
                    gate.wait()
            if self.overlap == "none":  # no prefetch: upload only once the device finished computing
                dev.wait(dev.param_up, dev.record(dev.compute))
            if handoff:
                flight.cast_wait = time.perf_counter() - waiting
                flight.first_upload.append(dev.timer(dev.param_up))
            self._loaded[key] = _Loaded(
                {
                    g: dev.empty(self.store.groups[g].compute.numel(), self.store.groups[g].compute.dtype, dev.param_up)
                    for g in self._groups[stage.slot]
                }
            )
        loaded = self._loaded[key]
        for g, start, stop in self._parts(stage.slot, "W", action.parts)[action.part]:
            source = self.store.reads(g, flight.step)
            dev.copy_up(loaded.flats[g][start:stop], source[start:stop], dev.param_up)
        if action.is_last_part:
            loaded.ready = dev.record(dev.param_up)
            if handoff:
                flight.first_upload.append(dev.timer(dev.param_up))
            for g in self._trainable[stage.slot]:  # edge 1: after the flight's last, the cast may overwrite
                flight.mark_uploaded(g, loaded.ready)

    def _slot_tensors(self, stage: Stage, action: Action, gradients: bool = True) -> dict[int, dict[str, Tensor]]:
        """The slot's named device tensors per layer, with the compute stream ordered after their upload.

        Built once per slot. In stages with gradients every trainable parameter is its own leaf
        whose ``.grad`` is preset to a view of a zeroed flat buffer, so autograd accumulates there in
        place over the micro-batches, and the download is one flat copy per group. (Views of one
        flat leaf would make autograd build a full-size zero tensor per parameter per backward.)
        """
        loaded = self._loaded[(action.round, action.slot)]
        if loaded.tensors is not None:
            return loaded.tensors
        dev = self.device
        dev.wait(dev.compute, loaded.ready)
        for g, flat in loaded.flats.items():
            dev.keep_alive(flat, dev.compute)
            if gradients and stage.has_gradients and self.store.groups[g].trainable:
                loaded.grads[g] = torch.zeros_like(flat)
        leaves: dict[tuple[int, int], Tensor] = {}
        loaded.tensors = {}
        for i in stage.layers:
            named = {}
            for ref in self.store.layer_tensors[i]:
                key = (ref.group, ref.offset)
                if key not in leaves:
                    view = loaded.flats[ref.group][ref.offset : ref.offset + ref.numel].view(ref.shape)
                    if ref.group in loaded.grads:
                        view = view.detach().requires_grad_(True)
                        view.grad = loaded.grads[ref.group][ref.offset : ref.offset + ref.numel].view(ref.shape)
                    leaves[key] = view
                named[ref.name] = leaves[key]
            loaded.tensors[i] = named
        return loaded.tensors

    def _unload(self, stage: Stage, action: Action, flight: Flight) -> None:
        dev = self.device
        key = (action.round, action.slot)
        loaded = self._loaded[key]
        if not stage.has_gradients or flight.evaluating:
            if action.is_last_part:
                del self._loaded[key]  # the allocator frees it after the compute stream is done with it
            return
        waits, done = flight.grad_order[key]
        overwrite = flight.overwrite[key]
        if action.is_first_part and loaded.backward_ran:
            dev.wait(dev.grad_down, loaded.last_compute)
            if any(g in overwrite for g in loaded.grads):
                for gate in waits:  # edge 4: the previous step's update has read the gradients
                    gate.wait()
            # The tail slot sums its later writes on the device once the host sums are complete. No
            # compute is left for this worker to issue in this batch, so the wait delays no kernel.
            summed_here = key == self._tail
            if summed_here and any(g not in overwrite for g in loaded.grads):
                for gate in waits:  # the previous writers (edge 4 too, where it is one of them)
                    gate.wait()
            for g, grad in loaded.grads.items():
                host = self.store.groups[g].grad
                assert host is not None
                if g in overwrite:  # first write since cleared: straight into the host gradient
                    loaded.downloads[g] = (grad, host)
                elif summed_here:
                    loaded.summed_here.add(g)
                    loaded.downloads[g] = (grad, host)
                else:
                    loaded.staging[g] = dev.pool.take(grad.numel(), grad.dtype)
                    loaded.downloads[g] = (grad, loaded.staging[g])
        for g, start, stop in self._parts(stage.slot, "G", action.parts)[action.part]:
            if g in loaded.downloads:
                source, destination = loaded.downloads[g]
                if g in loaded.summed_here:
                    self._add_on_device(source, destination, start, stop)
                else:
                    self._download_range(source, destination, start, stop)
        if action.is_last_part:
            copied = dev.record(dev.grad_down)
            for source, _ in loaded.downloads.values():
                dev.keep_alive(source, dev.grad_down)
            unwritten = [] if loaded.backward_ran else sorted(overwrite)  # no gradient reached them
            del self._loaded[key]  # from here the collector owns its staging buffers
            self.collector.submit(GradJob(loaded.staging, copied, waits, done, unwritten))
            self._collecting.append(done)
            if self.overlap == "none":  # no overlap: compute waits for the download
                dev.wait(dev.compute, copied)

    _CONVERT_CHUNK = 1 << 24  # elements converted at a time before a download (64 MiB in fp32)
    add_tail_on_device = True
    """Sum a settling batch's last gradient writes on the device (off: the collector adds them)."""

    def _add_on_device(self, source: Tensor, host: Tensor, start: int, stop: int) -> None:
        """``host[start:stop] += source[start:stop]``, summed on the device: the host's partial sum goes
        up in chunks through two device buffers, each chunk gets the device gradient added and comes
        back over the old values. Measured on one H200: the tied embedding's second write (311 M
        elements) took 123 ms to add on the host (2.5 G elements/s) after the last compute of a step, with
        nothing left to hide it; this moves 1.2 GB each way instead, both directions at once. The
        additions are the collector's (fp32 ``a + b`` is ``b + a``), so sums stay bit-identical."""
        dev = self.device
        size = min(self._CONVERT_CHUNK, stop - start)
        # Allocated on the stream that first writes them: a block freed on the gradients-down stream with
        # its download still queued (a converted chunk of the slot before) is not reused until that stream
        # is past it, and ``keep_alive`` below covers the adds and downloads that come after.
        buffers = [dev.empty(size, host.dtype, dev.param_up) for _ in range(2)]
        came_down: list[Any] = [None, None]
        for i, a in enumerate(range(start, stop, self._CONVERT_CHUNK)):
            b = min(stop, a + self._CONVERT_CHUNK)
            buffer = buffers[i % 2][: b - a]
            dev.wait(dev.param_up, came_down[i % 2])  # the chunk before last has left this buffer
            dev.copy_up(buffer, host[a:b], dev.param_up)
            dev.wait(dev.grad_down, dev.record(dev.param_up))
            with dev.on(dev.grad_down):
                buffer.add_(source[a:b])
            dev.copy_down(host[a:b], buffer, dev.grad_down)
            came_down[i % 2] = dev.record(dev.grad_down)
        for buffer in buffers:
            dev.keep_alive(buffer, dev.grad_down)

    def _download_range(self, source: Tensor, destination: Tensor, start: int, stop: int) -> None:
        """Copy ``source[start:stop]`` into host ``destination``; a dtype change (bf16 gradients into
        the fp32 host buffer) happens on the device in bounded chunks, never for the whole group."""
        dev = self.device
        if source.dtype == destination.dtype:
            dev.copy_down(destination[start:stop], source[start:stop], dev.grad_down)
            return
        for a in range(start, stop, self._CONVERT_CHUNK):
            b = min(stop, a + self._CONVERT_CHUNK)
            with dev.on(dev.grad_down):
                converted = source[a:b].to(destination.dtype)
            dev.copy_down(destination[a:b], converted, dev.grad_down)
            dev.keep_alive(converted, dev.grad_down)

    # ------------------------------------------------------------------ compute
    def _layer(self, index: int, tensors: dict[int, dict[str, Tensor]], x: Any, flight: Flight, microbatch: int) -> Any:
        """Run layer ``index`` of this worker's replicas on the slot's device tensors.

        The tensors are put into the replica's parameter and buffer slots for the call and the meta
        placeholders put back after (what ``functional_call`` does, without its per-call overhead).
        """
        seed = layer_seed(self.base_seed, flight.call, microbatch, index)
        named = tensors[index]
        slots = self._slots_of[index]
        for name, table, attr, _ in slots:
            table[attr] = named[name]
        try:
            with self.device.seeded(seed), self.device.autocast(self.autocast_dtype):
                return self.replicas[index](x)
        finally:
            for _, table, attr, placeholder in slots:
                table[attr] = placeholder

    def _take(self, flight: Flight, key: tuple[str, int, int]) -> tuple[Any, Any] | None:
        """Upload a mailbox's value to this device; ``None`` if it holds no value (a zero gradient)."""
        parcel = flight.take(key)
        if parcel is None:
            flight.release(key)
            return None
        value, ready = self.device.upload(parcel)
        flight.release(key, ready)
        return value, ready

    def _finish(self, loaded_key: tuple[int, int], done: Any) -> None:
        self._loaded[loaded_key].last_compute = done
        self._inflight.append(done)
        while len(self._inflight) > self.max_inflight:
            self.device.host_wait(self._inflight.popleft())

    def _forward(self, stage: Stage, action: Action, flight: Flight) -> None:
        dev, m = self.device, action.microbatch
        assert m is not None
        taken = self._take(flight, ("act", stage.start, m))
        assert taken is not None
        x, ready = taken
        with dev.on(dev.compute), torch.no_grad():
            weights = self._slot_tensors(stage, action)
            dev.wait(dev.compute, ready)
            start = dev.timer(dev.compute) if flight.record else None
            mark = dev.memory_mark() if flight.measure_memory else None
            for i in stage.layers:
                if i in self._saved and i != stage.start and not flight.evaluating:
                    flight.put(("act", i, m), dev.download(x, dev.record(dev.compute)))
                x = self._layer(i, weights, x, flight, m)
            done = dev.record(dev.compute)
            if mark is not None:
                flight.memory.append((action, dev.memory_peak_since(mark)))
            if flight.record:
                flight.records.setdefault(dev.index, []).append((action, start, None, dev.timer(dev.compute), 0))
        flight.put(("act", stage.stop, m), dev.download(x, done))
        self._finish((action.round, action.slot), done)

    def _loss(self, flight: Flight, output: Any, target: Any) -> Tensor:
        """``loss_fn`` on a micro-batch's output, under the workers' autocast; refused unless a scalar."""
        assert flight.loss_fn is not None
        with self.device.autocast(self.autocast_dtype):
            loss = flight.loss_fn(output, target)
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(f"loss_fn must return a scalar tensor, got {shape}")
        return loss

    def _evaluate(self, stage: Stage, action: Action, flight: Flight) -> None:
        """The fused stage of a forward-only pass: the last layers, then the loss (or the output itself)."""
        dev, m = self.device, action.microbatch
        assert m is not None
        taken = self._take(flight, ("act", stage.start, m))
        assert taken is not None
        x, x_ready = taken
        target = None
        if flight.loss_fn is not None:
            target = dev.upload(flight.targets[m])
            flight.pool.release(flight.targets[m], [target[1]])
            if flight.weights[m] == 0.0:  # nothing to average over (all targets ignored): adds 0, as in training
                flight.set_loss(m, Parcel(torch.zeros((), dtype=torch.float32)))
                return
        with dev.on(dev.compute), torch.no_grad():
            weights = self._slot_tensors(stage, action, gradients=False)
            for event in (x_ready, target and target[1]):
                dev.wait(dev.compute, event)
            for i in stage.layers:
                x = self._layer(i, weights, x, flight, m)
            if flight.loss_fn is not None:
                assert target is not None
                x = self._loss(flight, x, target[0]).detach().float() * flight.weights[m]
            done = dev.record(dev.compute)
        flight.set_loss(m, dev.download(x, done))
        self._finish((action.round, action.slot), done)

    def _backward(self, stage: Stage, action: Action, flight: Flight) -> None:
        """Fused stage (forward, loss, backward) or backward stage (recompute, backward)."""
        dev, m = self.device, action.microbatch
        assert m is not None
        fused = action.op is Op.FUSED
        taken = self._take(flight, ("act", stage.start, m))
        assert taken is not None
        x, x_ready = taken
        grads_in = None if fused else self._take(flight, ("grad", stage.stop, m))
        target = None
        if fused:
            target = dev.upload(flight.targets[m])
            flight.pool.release(flight.targets[m], [target[1]])
        if fused and flight.weights[m] == 0.0:
            flight.set_loss(m, Parcel(torch.zeros((), dtype=torch.float32)))
        if (fused and flight.weights[m] == 0.0) or (not fused and grads_in is None):
            # Nothing of this micro-batch reaches the loss: its gradients are zero.
            if stage.start > 0:
                flight.put(("grad", stage.start, m), None)
            return
        with dev.on(dev.compute):
            weights = self._slot_tensors(stage, action)
            for event in (x_ready, grads_in and grads_in[1], target and target[1]):
                dev.wait(dev.compute, event)
            leaves, spec = tree_flatten(x)
            if stage.start > 0:
                leaves = [t.requires_grad_() if _differentiable(t) else t for t in leaves]
            start = dev.timer(dev.compute) if flight.record else None
            weights_storage = {flat.untyped_storage().data_ptr() for flat in weights_flats(self._loaded, action)}
            saved = _SavedBytes(weights_storage) if flight.record else contextlib.nullcontext()
            mark = dev.memory_mark() if flight.measure_memory else None
            with torch.enable_grad(), saved:
                # Layers get non-leaf copies, so an in-place first operation (ReLU(inplace=True)) is legal.
                x = tree_unflatten(
                    [t.clone() if isinstance(t, Tensor) and t.requires_grad else t for t in leaves], spec
                )
                for i in stage.layers:
                    x = self._layer(i, weights, x, flight, m)
                if fused:
                    assert target is not None
                    loss = self._loss(flight, x, target[0])
                    weighted = loss.detach().float() * flight.weights[m]
                    roots, root_grads = [loss * (flight.weights[m] * flight.grad_scale)], None
                else:
                    assert grads_in is not None
                    pairs = [
                        (o, g)
                        for o, g in zip(tree_flatten(x)[0], grads_in[0])
                        if g is not None and isinstance(o, Tensor) and o.requires_grad
                    ]
                    roots, root_grads = [o for o, _ in pairs], [g for _, g in pairs]
            mid = dev.timer(dev.compute) if flight.record else None
            if roots:
                torch.autograd.backward(roots, root_grads)
                self._loaded[(action.round, action.slot)].backward_ran = True
            done = dev.record(dev.compute)
            if mark is not None:
                grads = sum(self.store.groups[g].compute.nbytes for g in self._trainable[stage.slot])
                flight.memory.append((action, max(0, dev.memory_peak_since(mark) - saved.bytes - grads)))
            if flight.record:
                end = dev.timer(dev.compute)
                flight.records.setdefault(dev.index, []).append((action, start, mid, end, saved.bytes))
        if fused:
            flight.set_loss(m, dev.download(weighted, done))
        if stage.start > 0:
            grads = [t.grad if isinstance(t, Tensor) and t.requires_grad else None for t in leaves]
            has_any = any(g is not None for g in grads)
            flight.put(("grad", stage.start, m), dev.download(grads, done) if has_any else None)
        self._finish((action.round, action.slot), done)


def tail_slot(actions: Sequence[Action], downloads: Callable[[int], bool]) -> tuple[int, int] | None:
    """(round, slot) of the last slot whose unload in this worker's ``actions`` downloads gradients
    (``downloads(slot)``: a stage with gradients and trainable groups), if no compute follows the start
    of that unload: then nothing is left to hide a host add behind. ``None`` otherwise (a later
    round's forward stage may come after it)."""
    last_compute = max((i for i, a in enumerate(actions) if a.op.is_compute), default=-1)
    for i in range(len(actions) - 1, -1, -1):
        a = actions[i]
        if a.op is Op.UNLOAD and a.is_first_part and downloads(a.slot):
            return (a.round, a.slot) if i > last_compute else None
    return None


def _tensor_slots(replica: nn.Module, refs: Sequence[Any]) -> list[tuple[str, dict[str, Any], str, Any]]:
    """Where each named tensor of a layer lives in its replica: (name, the owning module's parameter or
    buffer table, attribute, meta placeholder)."""
    slots = []
    for ref in refs:
        owner_name, _, attr = ref.name.rpartition(".")
        owner = replica.get_submodule(owner_name)
        table = owner._parameters if attr in owner._parameters else owner._buffers
        slots.append((ref.name, table, attr, table[attr]))
    return slots


def weights_flats(loaded: dict[tuple[int, int], _Loaded], action: Action) -> list[Tensor]:
    """The device buffers of a slot's weights and gradients (their memory is not activation memory)."""
    entry = loaded[(action.round, action.slot)]
    return [*entry.flats.values(), *entry.grads.values()]


class _SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Counts the activation bytes autograd saves for backward inside the block (each storage once;
    the stage's weights, which it saves too, excluded)."""

    def __init__(self, exclude: set[int]) -> None:
        self.bytes = 0
        seen: set[int] = set(exclude)

        def pack(t: Tensor) -> Tensor:
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                self.bytes += t.untyped_storage().nbytes()
            return t

        super().__init__(pack, lambda t: t)


def _differentiable(t: Any) -> bool:
    return isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex())
