"""Stage executor: what one worker does for each action of a schedule, on its own device.

Every action only *issues* device work. Inputs arrive as parcels (host tensors plus the event after
which they are valid). The executor runs a batch's actions in order and hands each to the handler of
its kind, which share the worker's :class:`~lightning_roundpipe.runtime.slots.WorkerSlots`:
:mod:`~lightning_roundpipe.runtime.uploads` (weights up), :mod:`~lightning_roundpipe.runtime.compute`
(forward, evaluate, fused, backward) and :mod:`~lightning_roundpipe.runtime.unloads` (gradients down).
It owns what spans the batch: the abort check, error notes, and the settle and cleanup at its end.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_roundpipe.runtime.collector import GradCollector
from lightning_roundpipe.runtime.compute import StageCompute
from lightning_roundpipe.runtime.device import WorkerDevice
from lightning_roundpipe.runtime.flight import Flight
from lightning_roundpipe.runtime.host_pool import HostMemoryError
from lightning_roundpipe.runtime.host_store import HostStore
from lightning_roundpipe.runtime.replicas import Replicas
from lightning_roundpipe.runtime.slots import WorkerSlots
from lightning_roundpipe.runtime.unloads import GradientUnloads, tail_slot
from lightning_roundpipe.runtime.uploads import WeightUploads
from lightning_roundpipe.runtime.workers import PipelineAborted
from lightning_roundpipe.schedule.actions import Action, Op
from lightning_roundpipe.schedule.plan import StagePlan

MEASURING_NOTE = (
    "roundpipe: this was a batch that measures the layers (plan='auto' runs profile_steps of them, with one"
    " layer per stage). It keeps every layer's input on the host until backward; the plan that follows"
    " keeps only its backward stages' inputs, often far fewer. A plan passed to RoundPipeStrategy skips"
    " this measurement; RoundPipeMonitor(layer_costs=...) prints the automatic plan of a run."
)


def raised_by_compile(error: BaseException) -> bool:
    """Whether ``error`` came from compiling, not from running compiled code (a bad token id or an
    out-of-memory in a compiled block is the model's or the card's): torch.compile's own error types, or a
    compiler in the traceback, e.g. a backward graph compiled lazily at the first backward, which fails as
    a plain ``RuntimeError``."""
    if isinstance(error, torch.OutOfMemoryError):
        return False
    if type(error).__module__.startswith(("torch._dynamo", "torch._inductor")):
        return True
    return any(frame.name in _COMPILING for frame in traceback.extract_tb(error.__traceback__))


COMPILE_NOTE = "(torch.compile failed: RoundPipeStrategy(compile=False) runs layers eagerly)"
_COMPILING = frozenset(
    {"get_or_compile", "_wrapped_bw_compiler", "bw_compiler", "fw_compiler_base", "compile_fx_inner", "compile_fx"}
)
"""Functions that compile graphs (AOTAutograd's lazy backward, dynamo's backend wrapper, Inductor's)."""


class StageExecutor:
    """Runs the actions of one worker against a flight."""

    add_tail_on_device = True
    """Sum a settling batch's last gradient writes on the device (off: the collector adds them)."""

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
        self.collector = collector
        self._on_error = on_error
        self._replicas = Replicas(device, layers, store.layer_tensors, base_seed, autocast_dtype)
        self._slots = WorkerSlots(device, store, plan)
        self._uploads = WeightUploads(self._slots, overlap)
        self._compute = StageCompute(self._slots, self._replicas, max_inflight)
        self._unloads = GradientUnloads(self._slots, collector, overlap)
        self._idle_since: float | None = None  # when this worker finished its last batch's actions
        self.trace: list[tuple[Any, ...]] | None = None
        """When a list: (\"action\", worker, batch, action, start time) is appended for every action."""

    @property
    def slots(self) -> WorkerSlots:
        """What this worker's handlers share (the engine sets its resident states there)."""
        return self._slots

    def give_back_ahead(self) -> None:
        """Drop the buffers taken for the next batch's first upload (before the caches are given back)."""
        self._uploads.ahead = None

    @property
    def base_seed(self) -> int:
        """Seed of the layers' generators; the engine sets it when it loads a saved state."""
        return self._replicas.base_seed

    @base_seed.setter
    def base_seed(self, value: int) -> None:
        self._replicas.base_seed = value

    def _out_of_memory_note(self, action: Action) -> str:
        """What ran out, and what to change: the stage's layers, the device's memory, the knobs."""
        stage = self._slots.stages[action.slot]
        where = f"stage {action.slot} ({stage.kind.name.lower()}, layers {stage.start}-{stage.stop - 1})"
        memory = ""
        if self.device.device.type == "cuda":
            allocated = torch.cuda.memory_allocated(self.device.device) / 2**30
            reserved = torch.cuda.memory_reserved(self.device.device) / 2**30
            memory = (
                f" on {self.device.device}: {allocated:.2f} GiB allocated, {reserved - allocated:.2f} GiB reserved"
                " by PyTorch but unallocated (fragmentation)"
            )
        states = ""
        if (resident := self._slots.resident) is not None:
            states = (
                f" The optimizer's states take {resident.need / 2**30:.2f} GiB of this device beside the plan"
                " (optimizer_on='device', or 'auto' where they take at most half of gpu_memory):"
                " RoundPipeStrategy(optimizer_on='host') keeps them in host memory and leaves the plan all of it."
            )
        return (
            f"roundpipe: {where} ran out of memory{memory}. Lower RoundPipeStrategy(gpu_memory=...) so the"
            " automatic plan makes smaller stages, or pass a plan with smaller stages; use more micro-batches"
            f" (num_microbatches) or a smaller batch or shorter sequences. docs/tuning.md has more.{states}"
        )

    # ------------------------------------------------------------------ one batch
    def run(
        self, actions: Sequence[Action], flight: Flight, attributes: list[list[dict[str, Any]]], settle: bool = True
    ) -> None:
        """Run one batch's actions in order; with ``settle``, also wait until their effects landed on the
        host (the synchronous mode; the asynchronous one goes straight on to the next batch)."""
        self._replicas.apply(attributes)
        self._slots.use_plan(flight.schedule.plan)
        self._uploads.begin(actions, flight, settle)
        self._unloads.tail = None
        self._unloads.staging_cap = 2 * self._slots.largest_gradients() if settle else None
        if settle and self.add_tail_on_device and not flight.evaluating:
            self._unloads.tail = tail_slot(actions, self._slots.downloads_gradients)
        if flight.record:
            flight.references[self.device.index] = (self.device.timer(self.device.compute), time.perf_counter())
        if self._idle_since is not None:
            flight.waited("launch", self._idle_since)
        try:
            for i, action in enumerate(actions):
                if flight.abort.is_set():
                    raise PipelineAborted
                try:
                    for load in self._uploads.reserve_at.get(i, ()):  # an out-of-memory there is that upload's
                        action = load
                        self._uploads.reserve(load, flight)
                    action = actions[i]
                    if i == self._uploads.ahead_at:
                        self._uploads.reserve_ahead(flight)
                    self._run(action, flight)
                    self._uploads.computed(i)
                except PipelineAborted:
                    raise
                except BaseException as e:
                    if hasattr(e, "add_note"):
                        e.add_note(f"(raised by roundpipe worker {self.device.index} running action {action})")
                        if raised_by_compile(e):
                            e.add_note(COMPILE_NOTE)
                        if isinstance(e, torch.OutOfMemoryError):
                            e.add_note(self._out_of_memory_note(action))
                        if isinstance(e, HostMemoryError) and flight.measure_memory:
                            e.add_note(MEASURING_NOTE)
                    if flight.recovers_from(e):  # this batch alone stops; the engine runs it again
                        flight.fail(e, action, self.device.device)
                        raise PipelineAborted from None
                    raise
            if settle:
                for gate in self._unloads.collecting:
                    gate.wait()
        except PipelineAborted:
            settle = True
            self.give_back_ahead()
            raise
        except BaseException as e:
            settle = True
            self.give_back_ahead()
            self._on_error(e)  # abort the others now, before waiting for the collector below
            raise
        finally:
            if settle:
                self.collector.drain()
                self.device.synchronize()
                self._compute.inflight.clear()
                for loaded in self._slots.loaded.values():  # an aborted slot's gradients never reached the collector
                    for buffer in loaded.staging.values():
                        self.device.pool.give(buffer)
            self._slots.loaded.clear()
            self._unloads.collecting.clear()
            self._idle_since = time.perf_counter()

    def _run(self, action: Action, flight: Flight) -> None:
        """One action, by its kind (tests patch this to delay or fail single actions)."""
        stage = self._slots.stages[action.slot]
        if self.trace is not None:
            self.trace.append(("action", self.device.index, flight.call, str(action), time.perf_counter()))
        if action.op is Op.LOAD:
            self._uploads.load(stage, action, flight)
        elif action.op is Op.UNLOAD:
            self._unloads.unload(stage, action, flight)
        elif action.op is Op.FORWARD:
            self._compute.forward(stage, action, flight)
        elif flight.evaluating:
            self._compute.evaluate(stage, action, flight)
        elif action.op is Op.FUSED:
            self._compute.fused(stage, action, flight)
        else:
            self._compute.backward(stage, action, flight)
