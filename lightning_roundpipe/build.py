"""Building the engine the strategy asked for: the host-memory check, the worker devices, the engine."""

from __future__ import annotations

import contextlib
import re
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_roundpipe.engine import PipelineEngine
from lightning_roundpipe.engine.planner import unchanged
from lightning_roundpipe.engine.state import engine_state
from lightning_roundpipe.host_optimizer import check_coupling, check_host_step, needs_a_gpu, use_fused_kernels
from lightning_roundpipe.memory import check_host_memory, estimate_host_memory, fits_host
from lightning_roundpipe.options import RoundPipeOptions, device_memory_limit
from lightning_roundpipe.runtime.callers import outside_package
from lightning_roundpipe.runtime.device import CudaWorkerDevice, WorkerDevice, expandable_segments
from lightning_roundpipe.runtime.one_pass import OnePass
from lightning_roundpipe.runtime.placement import AUTO_SHARE, STATES_MOST, deepest_share, resident_bytes
from lightning_roundpipe.runtime.resident import EDITED
from lightning_roundpipe.runtime.shadow import wrapped_optimizer


def worker_devices(devices: list[torch.device]) -> list[WorkerDevice]:
    """One worker per device Lightning gave the strategy: CUDA devices, or CPU threads standing in."""
    workers: list[WorkerDevice] = []
    if any(device.type == "cuda" for device in devices):
        expandable_segments()  # before the workers allocate (PYTORCH_CUDA_ALLOC_CONF keeps the user's choice)
    for index, device in enumerate(devices):
        if device.type == "cuda":
            workers.append(CudaWorkerDevice(device, index))
        elif device.type == "cpu":
            workers.append(WorkerDevice(device, index))
        else:
            raise ValueError(
                f"roundpipe workers run on CUDA devices or CPU threads, not {device.type!r}: use"
                " `accelerator='gpu'` or `accelerator='cpu'`."
            )
    return workers


def build_engine(
    layers: list[nn.Module],
    devices: list[torch.device],
    options: RoundPipeOptions,
    compute_dtype: torch.dtype | None,
    asynchronous: bool,
    training: bool,
    num_nodes: int = 1,
    autocast_dtype: torch.dtype | None = None,
    optimizers: Sequence[Any] = (),
) -> PipelineEngine:
    """The engine over ``layers``, after refusing (with the table) a run the host could not hold; without
    ``training`` (validate, test, predict) it only runs forward passes and has no optimizer thread."""
    params = [p for layer in layers for p in layer.parameters()]
    trainable = next((p for p in params if p.requires_grad), None)
    size = trainable.element_size() if trainable is not None else 4
    state_bytes = 2.0 * size / num_nodes if training else 0.0  # AdamW's two moments, sharded over nodes
    buffering = _double_buffer(options.double_buffer, params, compute_dtype, asynchronous, state_bytes)
    estimate = estimate_host_memory(params, compute_dtype, asynchronous, state_bytes, double_buffer=buffering)
    if options.host_memory_check:  # refuse now, with the numbers, rather than be killed halfway
        leaner = {}
        if asynchronous:  # no separate compute copy where no cast is needed (bf16-true, 32-true)
            synchronous = estimate_host_memory(params, compute_dtype, False, state_bytes)
            if synchronous.new < estimate.new:
                leaner["RoundPipeStrategy(async_optimizer=False)"] = synchronous
        check_host_memory(estimate, leaner=leaner)
    workers = worker_devices(devices)
    place, why = _place(options.optimizer_on if asynchronous else "host", num_nodes, autocast_dtype, optimizers)
    memory_limit = device_memory_limit(devices, float(options.gpu_memory))
    engine = PipelineEngine(
        layers,
        workers,
        plan=options.plan,
        microbatches_per_round=options.num_microbatches,
        num_rounds=options.num_rounds,
        overlap=options.overlap,
        compute_dtype=compute_dtype,
        autocast_dtype=autocast_dtype,
        asynchronous=asynchronous,
        profile_steps=options.profile_steps,
        planner=options.planner,
        check_every=options.check_every,
        replan_margin=options.replan_margin,
        memory_limit=memory_limit,
        double_buffer=buffering,
        optimizer_on=place,
        one_pass=_one_pass(options, optimizers),
    )
    if options.optimizer_on == "auto" and training:
        if engine.resident is not None:
            rank_zero_info("roundpipe: the optimizer's states on the GPU (optimizer_on='auto')")
        else:
            why = why or _too_big(engine, workers, memory_limit)
            rank_zero_info(f"roundpipe: the optimizer's states in host memory (optimizer_on='auto': {why})")
    return engine


def _double_buffer(
    given: str, params: list[nn.Parameter], compute_dtype: torch.dtype | None, asynchronous: bool, state_bytes: float
) -> str:
    """``double_buffer`` as the engine takes it: ``"auto"`` is ``"all"`` where spares (a compute copy per trainable
    weight, held groups' counted too) fit the host beside the rest, else ``"none"``, said in the log; synchronous
    steps have none. A rebuild carries the first engine's answer (:func:`_rebuilt`)."""
    if not asynchronous:
        return "none"
    if given != "auto":
        return given
    spares = estimate_host_memory(params, compute_dtype, asynchronous, state_bytes, double_buffer="all")
    if fits_host(spares):
        return "all"
    rank_zero_info(
        f"roundpipe: no spare compute copies (double_buffer='auto'): their {spares.compute_copies / 2 / 2**30:.2f}"
        " GiB would not fit the host beside the rest; each update's cast waits for the next step's last read"
    )
    return "none"


def _one_pass(options: RoundPipeOptions, optimizers: Sequence[Any]) -> bool:
    """Whether to build the one-pass AdamW kernel (with ``double_buffer="all"``): not under ``compile=False`` (no
    C++ compiler wanted), nor for optimizers none of which can take it (once they are known)."""
    return options.compile is not False and (not optimizers or any(OnePass.usable(o) for o in optimizers))


@dataclass
class EngineArguments:
    """What an engine is built again from (:func:`build_again`, :func:`fresh_engine`), besides the old engine."""

    layers: list[nn.Module]
    devices: list[torch.device]
    options: RoundPipeOptions
    precision: Any
    optimizers: Sequence[Any]
    num_nodes: int


def build_again(engine: PipelineEngine, arguments: EngineArguments) -> PipelineEngine:
    """Before a training batch after parameters were frozen or unfrozen (Lightning's BackboneFinetuning at an
    epoch's start): between optimizer steps on one node, the engine built again over the same layers for the
    parameters trainable now. The pending update lands first; the batch and step counters and the seed carry
    over; the layers are measured again; and the next step computes on the latest weights (no update pending
    across the rebuild, where the asynchronous optimizer would otherwise compute one step stale). Elsewhere the
    engine as it was, which refuses the batch, saying why."""
    changed = engine.store.changed_trainable()
    if not changed or arguments.num_nodes > 1 or not engine.steps.between_steps():
        return engine
    engine.crew.check_usable()  # (after a failure the flush would not say so)
    engine.flush()
    state = engine_state(engine, compute=False)  # (the new engine computes on the latest weights)
    carried = {k: state[k] for k in ("calls", "step", "dispatch_position", "base_seed", "loss_scales") if k in state}
    again = _rebuilt(engine, arguments)
    again.load_state_dict(carried)
    rank_zero_info(
        f"roundpipe: parameters of layers {changed} were frozen or unfrozen: the engine was built again for the"
        " parameters trainable now (its layers are measured again)"
    )
    return again


def build_placed(
    engine: PipelineEngine, arguments: EngineArguments, place: str | float, seconds: dict[str, float] | None = None
) -> PipelineEngine | None:
    """Between optimizer steps, the engine built again with its optimizer's states where ``place`` says (a share
    of them on the GPU, or the host): the pending update lands first, the counters, plan and measured layer costs
    carry over (nothing is measured again), and the plan is chosen again for what the states leave of the device.
    ``None`` (the engine as it was) where no batch may come between, or no plan fits beside those states.
    ``seconds``: filled with what each part took (every state moved on an H100 80GB took an 11 s step)."""
    planner, store = engine.planner, engine.store
    if not engine.steps.between_steps():
        return None
    if planner.profile is None and planner.fitted is not None and planner.memory_limit is not None:
        limit = planner.memory_limit + (0 if engine.resident is None else engine.resident.need)  # states and plan
        groups = () if place == "host" else None if place == "device" else deepest_share(store, place)
        held = resident_bytes(store, groups=groups)  # (None: every trainable group)
        with unchanged(planner):  # (the running plan's costs: what the state saves)
            if held >= STATES_MOST * limit or planner.plan_for_memory(store, limit - held) is None:
                return None  # (past STATES_MOST the engine built with them would refuse them)
    engine.crew.check_usable()  # (after a failure the flush would not say so)
    with _timed(seconds, "flush"):
        engine.flush()
    with _timed(seconds, "state"):
        state = engine_state(engine, compute=False)  # (the new engine computes on the latest weights)
    with _timed(seconds, "build"):
        again = _rebuilt(engine, replace(arguments, options=replace(arguments.options, optimizer_on=place)))
    with _timed(seconds, "load"):
        again.load_state_dict(state)
    planner = again.planner
    with _timed(seconds, "plan"):
        if planner.profile is None and (plan := planner.plan_for_memory(again.store, planner.memory_limit)) is not None:
            again.set_plan(plan)  # (measuring: it plans under the new limit after)
    return again


def back_after_edit(engine: PipelineEngine, arguments: Callable[[], EngineArguments]) -> PipelineEngine | None:
    """Where ``optimizer_on="auto"`` keeps the states on the GPU and the module's weights or the optimizer's state
    were edited during training (:meth:`ResidentStates.edited`: a callback clipping or masking the weights between
    steps), the engine built again with them on the host, where such edits take effect as in plain training; on
    the GPU every later edit would be replaced by the device's values too, each after a flush. This edit is
    replaced (the host's copy is up to one update behind the device's). Between steps only; ``arguments``: asked
    for only after an edit. ``None``: nothing to do, or not now."""
    resident = engine.resident
    if resident is None or not engine.steps.between_steps() or not resident.edited():
        return None
    if (given := arguments()).options.optimizer_on != "auto":
        return None
    with warnings.catch_warnings():  # (the flush's warning about this edit: said once below instead)
        warnings.filterwarnings("ignore", message=re.escape(EDITED))
        back = build_placed(engine, given, "host")
    if back is not None:
        warnings.warn(
            "roundpipe: the module's weights or the optimizer's state were edited during training (a callback"
            " clipping or masking the weights, say) while optimizer_on='auto' kept them on the GPU, where the"
            " device's values, updated since, replace such edits: this one was replaced, and from here on they are"
            " on the host, where edits take effect (RoundPipeStrategy(optimizer_on='host') keeps the first too)",
            stacklevel=outside_package(),
        )
    return back


@contextlib.contextmanager
def _timed(seconds: dict[str, float] | None, name: str) -> Iterator[None]:
    """The block's wall seconds, the GPU's queued work included, into ``seconds[name]`` (nothing where ``None``)."""
    start = time.perf_counter()
    yield
    if seconds is not None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds[name] = time.perf_counter() - start


def could_share(engine: PipelineEngine, arguments: EngineArguments) -> bool:
    """Whether ``optimizer_on="auto"`` left the states on the host only because they take more than
    :data:`AUTO_SHARE` of the one GPU's limit, so that a share of them may go there (:mod:`host_clock`; the planner
    chooses the plan, so that one can be chosen again for what the share leaves)."""
    precision, options = arguments.precision, arguments.options
    place, _ = _place(options.optimizer_on, arguments.num_nodes, precision.autocast_dtype, arguments.optimizers)
    eligible = engine.asynchronous and engine.consistency == "layerwise" and engine.crew.optimizer is not None
    one_gpu = len(engine.devices) == 1 and engine.caches.ceiling is not None
    return place == "auto" and engine.resident is None and eligible and one_gpu and engine.planner.auto


def fresh_engine(engine: PipelineEngine, arguments: EngineArguments) -> PipelineEngine:
    """Where a checkpoint is loaded into a run whose engine has run batches (Lightning's learning-rate finder
    restores the checkpoint it saved before its trial steps), a new engine over the same layers, which takes the
    checkpoint's engine state as at a resume; an engine that has run none as it is."""
    return engine if not engine.calls else _rebuilt(engine, arguments)


def _rebuilt(engine: PipelineEngine, arguments: EngineArguments) -> PipelineEngine:
    engine.close()
    engine.store.release()  # only the masters stay (they are the parameters): the new store copies them
    for device in engine.devices:  # the old plan's cached blocks: the new engine's (every state on an H100 80GB
        device.release_cached()  # beside another plan) reused some and grew the reserve 2.5 GiB past the limit
    precision, options = arguments.precision, arguments.options
    if options.double_buffer == "auto":  # as first decided: the states the estimate counts exist by now, so the
        options = replace(options, double_buffer=engine.steps.double_buffer)  # host would seem to hold less
    again = build_engine(
        arguments.layers, arguments.devices, options, precision.compute_dtype, engine.asynchronous, True,
        arguments.num_nodes, precision.autocast_dtype, arguments.optimizers,
    )  # fmt: skip
    use_fused_kernels(list(arguments.optimizers), calibrate=False)  # a group added for the unfrozen parameters
    return again


def _place(
    place: str | float, num_nodes: int, autocast_dtype: torch.dtype | None, optimizers: Sequence[Any]
) -> tuple[str | float, str]:
    """``optimizer_on`` with the strategy's reasons for the host applied to ``"auto"``, and the reason."""
    if place != "auto":
        return place, ""
    if num_nodes > 1:
        return "host", "several nodes exchange through the host optimizer"
    if autocast_dtype == torch.float16:
        return "host", "16-mixed scales its losses on the host optimizer"
    for optimizer in optimizers:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # Lightning's LightningOptimizer
        if not type(optimizer).__module__.startswith("torch.optim") and not needs_a_gpu(optimizer):
            return "host", (
                f"{type(optimizer).__name__} is not one of torch.optim's, whose steps run on a GPU as on the host;"
                " optimizer_on='device' tries it there"
            )
    return place, ""


def _too_big(engine: PipelineEngine, workers: list[WorkerDevice], memory_limit: float | None) -> str:
    """Why the engine kept ``"auto"``'s states on the host (the rules of
    :func:`~lightning_roundpipe.runtime.resident.place_states`)."""
    if memory_limit is None:
        return "CPU workers"
    if len(workers) > 1:
        return f"{len(workers)} GPUs share the steps"
    from lightning_roundpipe.host_clock import ShareSwitch  # (it builds engines: imported when asked)

    need = resident_bytes(engine.store)
    later = ShareSwitch.whole and need < STATES_MOST * memory_limit
    return (
        f"their {need / 2**30:.1f} GiB are more than {AUTO_SHARE:.0%} of the {memory_limit / 2**30:.1f} GiB"
        " gpu_memory allows" + ("; all of them move there once a plan beside them is about as fast" if later else "")
    )


ONE_OPTIMIZER = (
    "For several optimizers, put the parameters in groups of one optimizer, each group with its own settings, e.g."
    " torch.optim.AdamW([{'params': body.parameters(), 'lr': 1e-5}, {'params': head.parameters(), 'lr': 1e-3}]);"
    " a scheduler then schedules every group (LambdaLR takes one function per group)."
)


def setup_optimizers(strategy: Any, trainer: Any) -> None:
    """Lightning's optimizers; where it refuses several, what to do under roundpipe (its own message points to
    manual optimization, which roundpipe does not support: the host steps one optimizer for every parameter)."""
    try:
        strategy.setup_optimizers(trainer)
    except RuntimeError as error:
        if "multiple optimizers" not in str(error):
            raise
        raise ValueError(
            "roundpipe trains with one optimizer, stepped on the host; manual optimization is not supported."
            f" {ONE_OPTIMIZER}"
        ) from error


def needs_main_thread(module: Any, optimizers: list[Any], is_overridden: Any) -> str | None:
    """Why this fit must step the optimizer on the main thread (the synchronous optimizer), said as a warning,
    else ``None``: a hook the asynchronous optimizer's thread would never call (``is_overridden``: Lightning's,
    of the strategy's flavour), or an optimizer its thread cannot shadow."""
    if is_overridden("configure_gradient_clipping", module):
        return (
            f"{type(module).__name__} overrides configure_gradient_clipping, which clips the gradients on the main"
            " thread; the asynchronous optimizer applies them on its own thread, where the hook would never be"
            " called: this fit uses the synchronous optimizer (async_optimizer=False)."
            " Trainer(gradient_clip_val=..., gradient_clip_algorithm=...) clips on the asynchronous optimizer's"
            " thread instead."
        )
    for optimizer in optimizers:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # Lightning's LightningOptimizer
        if (name := wrapped_optimizer(optimizer)) is not None:
            return (
                f"{type(optimizer).__name__} steps another optimizer (its {name!r}), which the asynchronous"
                " optimizer's thread cannot step over its own copies of the parameters: this fit uses the"
                " synchronous optimizer (async_optimizer=False)."
            )
    return None


def check_optimizers(optimizers: list[Any], engine: PipelineEngine | None, num_nodes: int, asynchronous: bool) -> None:
    """Once the engine is built: the host's step at full speed (unless chosen otherwise), and refused where the
    host cannot step it (where it steps any group) or cannot step its groups apart (several nodes, or a share of
    the states on the GPU stepping the rest apart), before the first batch."""
    use_fused_kernels(optimizers)
    resident = engine.resident if engine is not None else None
    check_host_step(optimizers, on_device=resident is not None and resident.whole)
    if asynchronous:
        check_coupling(optimizers, num_nodes, split=resident is not None and not resident.whole)
