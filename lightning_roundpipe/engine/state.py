"""The engine's part of a checkpoint: what resuming exactly needs besides the weights and the optimizer.

That is the batch and step counters (part of every random seed), the dispatch position, the plan and
the costs it came from with its drift bookkeeping, the measurements a plan is chosen again from, and, in
asynchronous mode, the compute copies: the masters already hold the last submitted update, but the next
batch must compute on the weights without it (staleness 1). The format is kept here only, and checkpoints
of earlier releases still load.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from lightning_roundpipe.runtime.profile import LayerProfile
from lightning_roundpipe.schedule.partition import LayerCosts
from lightning_roundpipe.schedule.plan import StagePlan

if TYPE_CHECKING:
    from lightning_roundpipe.engine.pipeline import PipelineEngine


def engine_state(engine: PipelineEngine, compute: bool = True) -> dict[str, Any]:
    """The state to save; call after a flush and once early casts settled (``compute=False``: without the compute
    copies a pending update needs, for an engine built again over the same layers)."""
    planner, steps = engine.planner, engine.steps
    plan, count, limit = engine.caches.settled()  # mid-trial: the plan before the one on trial
    state: dict[str, Any] = {
        "calls": engine.calls,
        "step": steps.step,
        "dispatch_position": engine.dispatch_position,
        "base_seed": engine.base_seed,
        "plan": str(plan),
        "layer_costs": None if planner.layer_costs is None else asdict(planner.layer_costs),
        "drift_reference": planner.reference if plan == planner.plan else None,
        "drifted": planner.drifted,
        "offset_checked": planner.offset_checked,
        "profiling": planner.measuring,
        "microbatches_per_round": count,
        # lowered where a batch ran out of device memory, or a smaller plan paid; the device's optimizer states not
        # taken off (a run resumed with them on the host plans under the whole of it)
        "memory_limit": limit if limit is None or engine.resident is None else limit + engine.resident.need,
        "fitted": None if planner.fitted is None else planner.fitted.state(),  # what it plans again from
        "measured": [planner.batch_samples, *planner.measured_sizes()],  # costs are per element
        "transfers": [planner.transfers.boundary_per_element, planner.transfers.upload_rate],
    }
    optimizer = engine.crew.optimizer
    if optimizer is not None and optimizer.scales:  # 16-mixed: the scales the next two steps use
        state["loss_scales"] = {k: v for k, v in optimizer.scales.items() if k >= steps.step - 2}
    if compute and steps.asynchronous and steps.pending_casts():
        stash = engine.evaluator.stash or {}  # saved during validation: the copies set aside are the ones
        state["compute"] = {
            g: (stash[g] if g in stash else engine.store.reads(g, steps.step)).clone() for g in steps.trainable
        }
        resident = engine.resident
        if resident is not None and not resident.whole and steps.windows[steps.step].closed.is_set():
            for g in resident.held:  # after a step's announced last batch the host's groups hold the previous
                if g not in stash:  # update (settle_early_casts): the device's share alike, not one update behind
                    group = engine.store.groups[g]
                    state["compute"][g] = group.data.to(group.compute.dtype, copy=True)
    return state


def load_engine_state(engine: PipelineEngine, state: dict[str, Any]) -> None:
    """Continue where :func:`engine_state` left off, on a new engine before its first batch, after the
    masters (the module's parameters) were loaded."""
    engine.calls = int(state["calls"])
    engine.dispatch_position = int(state["dispatch_position"]) % engine.crew.num_workers
    engine.base_seed = int(state["base_seed"])
    engine.crew.set_seed(engine.base_seed)
    planner = engine.planner
    if planner.auto and state.get("layer_costs") is not None:
        planner.layer_costs = LayerCosts(**{k: tuple(v) for k, v in state["layer_costs"].items()})
        plan = StagePlan.parse(state["plan"])
        profiling = state.get("profiling", plan == LayerProfile.plan(planner.num_layers))  # older: by plan
        if profiling:
            planner.replan()  # saved while measuring again: measure anew
        elif plan.num_layers == planner.num_layers:
            planner.profile = None
            fitted = state.get("fitted")  # older checkpoints measured per sample (two "measured" values): not used
            if fitted is not None and int(fitted["num_layers"]) == planner.num_layers and len(state["measured"]) == 5:
                planner.fitted = LayerProfile.from_state(fitted)
                planner.batch_samples = int(state["measured"][0])
                planner.restore_sizes(state["measured"][1:])
                planner.transfers.boundary_per_element, planner.transfers.upload_rate = map(float, state["transfers"])
            if planner.chooses_microbatches and state.get("microbatches_per_round"):  # chosen with the plan
                planner.microbatches_per_round = int(state["microbatches_per_round"])
            if planner.fitted is not None:  # the sizes the plan's costs are for (drift checks scale to them)
                size = planner.batch_samples / max(1, min(planner.batch_samples, planner.num_microbatches))
                planner.planned_elements, planner.memory_elements = planner.sizes_for(size)
            engine.set_plan(plan)
            # the plan's own timing, so that a resumed run (another machine, say) is judged against it
            reference = state.get("drift_reference")
            if reference is not None and len(reference) == plan.num_slots:
                planner.reference, planner.drifted = list(reference), int(state.get("drifted", 0))
        planner.offset_checked = bool(state.get("offset_checked", False))
        saved = state.get("memory_limit")
        if saved is not None and engine.resident is not None:
            saved -= engine.resident.need  # what the plan may use beside the states
        if saved is not None and (planner.memory_limit is None or saved < planner.memory_limit):
            planner.memory_limit = float(saved)  # what the run learnt from running out of device memory
    compute = state.get("compute")
    if compute is not None and not engine.steps.asynchronous:
        raise ValueError(
            "this checkpoint was saved by the asynchronous optimizer with an update pending; resume it with"
            " RoundPipeStrategy(async_optimizer=True)"
        )
    if compute is not None and sorted(compute) != sorted(engine.steps.trainable):
        raise ValueError("the checkpoint's roundpipe state does not match this model's trainable layers")
    for step, scale in state.get("loss_scales", {}).items():
        if engine.crew.optimizer is not None:  # 16-mixed: the scales the next two steps use, as decided
            engine.crew.optimizer.decide(int(step), float(scale))
    engine.steps.resume(int(state["step"]), compute)
