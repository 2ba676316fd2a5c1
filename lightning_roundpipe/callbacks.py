"""``RoundPipeMonitor``: what the pipeline is doing, for every worker, through Lightning's loggers.

Like Lightning's ``DeviceStatsMonitor``, it logs every ``log_every_n_steps`` optimizer steps; it asks
the engine to time the next batch shortly before, so measuring costs nothing in between. Its files (the
timeline, the layer costs) need no logger.

``FlushFirst``, which the strategy puts before the user's callbacks: the pending update lands in the weights
before any callback's ``on_train_epoch_end`` and ``on_train_end`` (Lightning calls the strategy's own hook last).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil
import torch
from typing_extensions import override

from lightning_roundpipe._flavor import lightning_package
from lightning_roundpipe.runtime.compiles import compilations, compile_seconds
from lightning_roundpipe.schedule.actions import Action, Op
from lightning_roundpipe.schedule.plan import StagePlan

pl = lightning_package(globals())
_Callback = pl.Callback
_MisconfigurationException = pl.utilities.exceptions.MisconfigurationException


class RoundPipeMonitor(_Callback):  # type: ignore[misc,valid-type]
    """Logs per-worker utilisation, the bubble ratio next to the simulator's prediction, transfer
    bandwidth and memory; writes the layer costs the plan was made from, and a timeline of one step.

    Logged keys:

    - ``roundpipe/busy_worker{i}``: fraction of the measured step worker ``i``'s device computed
    - ``roundpipe/bubble_measured``: ``1 - mean(busy)``
    - ``roundpipe/bubble_predicted``: the simulator's bubble ratio for the running automatic plan, its
      measured layer costs and the measured handoff between batches; logged once a recorded batch on the
      plan measured that handoff (until then the prediction charges none: exactly 0.0 on one worker) and
      not while the layers are measured. It holds the schedule's own idle time and the handoff's median,
      not the host's longer turns (validation, checkpoints) that ``host_gap`` shows. A logged 0.0 is the
      simulator's answer where the handoff hides: asynchronously a fused slot's loss reaches the host
      before its backward, so one worker with every layer fused hides a handoff shorter than that backward
      (the simulator has no transfer model: docs/tuning.md)
    - ``roundpipe/bubble_in_step``: idle fraction between the step's first and last kernel (the
      pipeline's own bubble: compare it with the prediction on one worker or synchronously)
    - ``roundpipe/host_gap``: fraction of the step from its last kernel to the next step's first, when
      the devices wait for the host
    - ``roundpipe/handoff_s``: what the prediction charges between two batches (the host's turn, the
      first slot's wait for its casts and its upload; see ``StepStats.handoff``)
    - ``roundpipe/wait_{reason}_s``: seconds per batch the workers' threads were blocked, summed over
      workers, by reason (``casts``: an update's cast into the weights a slot uploads; ``update_reads``:
      an update reading the gradients a slot overwrites; ``inputs``, ``inflight``, ``launch``, ...; see
      ``Flight.waited``): what held the devices back when ``host_gap`` or the bubble is large
    - ``roundpipe/host_step_s``: seconds of the last host optimizer step (its math; asynchronously, the
      update of the step before); longer than the devices' step means the GPUs wait for the host
    - ``roundpipe/stages``: slots per round in the current plan
    - ``roundpipe/recovered_batches``: batches run again on a smaller plan after a device ran out of
      memory (docs/reliability.md)
    - ``roundpipe/memory_limit_gib``: what the plan's stages are sized for on a GPU (``gpu_memory``, lowered
      after running out of memory, or while a smaller plan is tried because the allocator kept freeing)
    - ``roundpipe/cache_releases``: batches after which a GPU's caching allocator held more than ``gpu_memory``
      of the card and gave its cache back (lengths that vary leave blocks no later batch asks for)
    - ``roundpipe/drift``: at the engine's last drift check, how far stage times moved from those the
      automatic plan first measured (relative to its slowest stage); past ``replan_margin`` twice in
      a row the layers are measured again
    - ``roundpipe/h2d_gbps``, ``roundpipe/d2h_gbps``: host-to-device and device-to-host bandwidth
      since the previous log
    - ``roundpipe/gpu_memory_gib_worker{i}``: memory in use on worker ``i``'s GPU (NVML)
    - ``roundpipe/host_rss_gib``: resident memory of this process
    - ``roundpipe/grad_norm``: the global 2-norm of an optimizer step's gradients before clipping
      (``grad_norm=True``), for the steps Lightning logs its own metrics under (every
      ``log_every_n_steps``). Synchronously from the gradients Lightning's hooks see; asynchronously the
      optimizer thread computes it where the gradients are (``on_before_optimizer_step`` sees none in
      that mode), and it is logged under its own step once that step's update ran (a step later)

    With ``Trainer(logger=False)`` nothing is logged, but the files asked for are written.

    The timeline holds one thread per worker, named ``worker i (device)``, and one event per compute
    action, named by the action's printed form ``round:OPslot.microbatch``: ``1:B7.2`` is round 1, the
    backward stage in slot 7, micro-batch 2. ``OP`` is ``F`` (forward only), ``L`` (the fused stage: the
    forward of the last layers, the loss and their backward) or ``B`` (recompute and backward); slots
    number a round's stages in dispatch order: forward stages, the fused stage, backward stages (the plan
    ``"4,4|1,4,4"`` has slots ``F0 F1 L2 B3 B4``). Each event's ``args`` spell it out (:func:`explain`):
    ``round``, ``op``, ``slot``, ``microbatch`` and the stage's ``layers``. Under ``plan="auto"`` the
    first measured step is usually one that measures the layers: one layer per stage, one micro-batch
    per round.

    Args:
        timeline: a path; the first measured step is written there as Chrome-trace JSON (open it in
            Perfetto), with a Gantt chart next to it as PNG when matplotlib is installed.
        layer_costs: a path for the measured per-layer costs (JSON), written whenever a plan is made and
            when its predicted bubble becomes known or moves.
        grad_norm: log ``roundpipe/grad_norm`` (one more pass over the host gradients per step).
    """

    def __init__(
        self, timeline: str | Path | None = None, layer_costs: str | Path | None = None, grad_norm: bool = True
    ) -> None:
        self.timeline = Path(timeline) if timeline is not None else None
        self.layer_costs = Path(layer_costs) if layer_costs is not None else None
        self.grad_norm = grad_norm
        self._norm_logged = -1  # asynchronous mode: the last step whose norm was logged
        self._last_bytes: tuple[int, int] | None = None
        self._last_time = 0.0
        self._written_costs: tuple[Any, float | None] = (None, None)  # the layer costs and prediction on file
        self._nvml: Any = None

    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        if not trainer.loggers and self.timeline is None and self.layer_costs is None:
            raise _MisconfigurationException(
                "`RoundPipeMonitor()` with `Trainer(logger=False)` has nothing to produce: its metrics need a"
                " logger. Pass one, or ask only for its files:"
                " `RoundPipeMonitor(timeline='step.json', layer_costs='costs.json')`."
            )
        if getattr(trainer.strategy, "strategy_name", None) != "roundpipe":
            raise _MisconfigurationException(
                f"`RoundPipeMonitor` reports on `Trainer(strategy='roundpipe')`; this Trainer uses"
                f" {type(trainer.strategy).__name__}."
            )
        trainer.strategy.measure_grad_norm = self.grad_norm and bool(trainer.loggers)  # nothing takes it otherwise

    @override
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        """Synchronous mode: the step's gradients are in ``p.grad`` here, unscaled and not yet clipped."""
        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        if not self.grad_norm or trainer.strategy.async_optimizer or not self._logs_step(trainer, step):
            return
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        self._log(trainer, {"roundpipe/grad_norm": norm}, step)

    def _log_async_grad_norm(self, trainer: Any, engine: Any) -> None:
        """The norms of the updates the optimizer thread ran since the last call, each under its own step
        where that step is one Lightning logs."""
        if not self.grad_norm or engine.crew.optimizer is None:
            return
        for step, norm in list(engine.crew.optimizer.grad_norms):
            if step > self._norm_logged:
                self._norm_logged = step
                if self._logs_step(trainer, step):
                    self._log(trainer, {"roundpipe/grad_norm": norm}, step)

    @staticmethod
    def _log(trainer: Any, metrics: dict[str, float], step: int) -> None:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    @override
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        engine = trainer.strategy.engine
        if engine is not None and engine.crew.optimizer is not None and self.grad_norm and trainer.loggers:
            engine.flush()  # the last step's update (and its norm)
            self._log_async_grad_norm(trainer, engine)

    @staticmethod
    def _logs_step(trainer: Any, step: int) -> bool:
        """Whether Lightning logs under ``step`` (its ``_batches_that_stepped``): every ``log_every_n_steps``,
        never for 0 or without a logger."""
        every = trainer.log_every_n_steps
        return bool(trainer.loggers) and every > 0 and (step + 1) % every == 0

    def _due(self, trainer: Any, ahead: int) -> bool:
        return self._logs_step(trainer, trainer.global_step + ahead - 1)

    @override
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        engine = trainer.strategy.engine
        wants_timeline = self.timeline is not None and not self.timeline.exists()
        if engine is not None and (self._due(trainer, 1) or wants_timeline):
            engine.planner.measure_next()

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        engine = trainer.strategy.engine
        if engine is None:
            return
        self._log_async_grad_norm(trainer, engine)
        on_file = (engine.planner.layer_costs, predicted_bubble(engine))
        if self.layer_costs is not None and on_file[0] is not None and on_file != self._written_costs:
            self._written_costs = on_file
            self._write_costs(engine)
        if self.timeline is not None and not self.timeline.exists() and engine.stats.last_timeline:
            devices = {d.index: str(d.device) for d in engine.devices}
            write_timeline(engine.stats.last_timeline, self.timeline, engine.stats.last_timeline_plan, devices)
        if not self._due(trainer, 0):
            return
        metrics: dict[str, float] = {
            "roundpipe/stages": float(engine.plan.num_slots),
            "roundpipe/recovered_batches": float(engine.recovery.recovered),
        }
        for worker, busy in engine.stats.busy.items():
            metrics[f"roundpipe/busy_worker{worker}"] = busy
        if engine.stats.busy:
            metrics["roundpipe/bubble_measured"] = 1.0 - sum(engine.stats.busy.values()) / engine.num_workers
        if (predicted := predicted_bubble(engine)) is not None:
            metrics["roundpipe/bubble_predicted"] = predicted
        if engine.stats.bubble_in_step is not None:
            metrics["roundpipe/bubble_in_step"] = engine.stats.bubble_in_step
        if engine.stats.host_gap is not None:
            metrics["roundpipe/host_gap"] = engine.stats.host_gap
        if engine.stats.handoff is not None:
            metrics["roundpipe/handoff_s"] = engine.stats.handoff
        for reason, seconds in engine.worker_waits.items():
            metrics[f"roundpipe/wait_{reason.replace(' ', '_')}_s"] = seconds
        host_step = getattr(trainer.strategy, "host_step_s", None)
        if host_step is not None:
            metrics["roundpipe/host_step_s"] = host_step
        if engine.planner.drift is not None:
            metrics["roundpipe/drift"] = engine.planner.drift
        if engine.planner.memory_limit is not None:
            metrics["roundpipe/memory_limit_gib"] = engine.planner.memory_limit / 2**30
        metrics["roundpipe/cache_releases"] = float(engine.caches.releases)
        now, moved = time.perf_counter(), engine.crew.transferred_bytes()
        if self._last_bytes is not None and now > self._last_time:
            metrics["roundpipe/h2d_gbps"] = (moved[0] - self._last_bytes[0]) / (now - self._last_time) / 1e9
            metrics["roundpipe/d2h_gbps"] = (moved[1] - self._last_bytes[1]) / (now - self._last_time) / 1e9
        self._last_bytes, self._last_time = moved, now
        if (compiled := compilations()) > 0:  # torch.compile in this process (compile=...): what it has cost
            metrics["roundpipe/compilations"], metrics["roundpipe/compile_s"] = float(compiled), compile_seconds()
        metrics.update(self._gpu_memory(engine))
        metrics["roundpipe/host_rss_gib"] = psutil.Process().memory_info().rss / 2**30
        self._log(trainer, metrics, trainer.fit_loop.epoch_loop._batches_that_stepped)

    def _gpu_memory(self, engine: Any) -> dict[str, float]:
        out: dict[str, float] = {}
        cuda = [(d.index, d.device.index or 0) for d in engine.devices if d.device.type == "cuda"]
        if not cuda:
            return out
        try:
            import pynvml

            if self._nvml is None:
                pynvml.nvmlInit()
                self._nvml = pynvml
            for worker, index in cuda:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                out[f"roundpipe/gpu_memory_gib_worker{worker}"] = pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**30
        except Exception:  # NVML unavailable (containers without the driver library): skip the metric
            pass
        return out

    def _write_costs(self, engine: Any) -> None:
        c = engine.planner.layer_costs
        assert self.layer_costs is not None
        self.layer_costs.parent.mkdir(parents=True, exist_ok=True)
        rows = {
            "plan": str(engine.plan),
            "microbatches_per_round": engine.planner.microbatches_per_round,
            "predicted_bubble": predicted_bubble(engine),
            "layers": [
                {
                    "forward_ms": f * 1e3,
                    "backward_ms": b * 1e3,
                    "params_bytes": p,
                    "grads_bytes": g,
                    "activation_bytes": a,
                }
                for f, b, p, g, a in zip(c.forward, c.backward, c.params, c.grads, c.backward_activations)
            ],
        }
        self.layer_costs.write_text(json.dumps(rows, indent=1))


def predicted_bubble(engine: Any) -> float | None:
    """The planner's predicted bubble once it is a prediction for the running plan: not while the layers
    are measured (the plan it was made for is not running), nor before a recorded batch on the plan
    measured the handoff between batches (until then it charges none)."""
    if engine.planner.measuring or engine.stats.handoff is None:
        return None
    return engine.planner.predicted_bubble


_OP_NAMES = {Op.LOAD: "upload", Op.FORWARD: "forward", Op.FUSED: "fused", Op.BACKWARD: "backward", Op.UNLOAD: "unload"}


def explain(action: str, plan: StagePlan | None = None) -> dict[str, Any]:
    """A timeline action's printed form (``"1:B7.2"``) spelled out for a trace event's ``args``: its round,
    op, slot, micro-batch, the stage's layers where the plan is known, and the part of a transfer cut into
    parts (``"0:W2~1/4"``)."""
    a = Action.parse(action)
    out: dict[str, Any] = {"round": a.round, "op": _OP_NAMES[a.op], "slot": a.slot}
    if a.microbatch is not None:
        out["microbatch"] = a.microbatch
    if plan is not None:
        out["layers"] = list(plan.stages()[a.slot].layers)
    if a.parts > 1:
        out["part"] = f"{a.part + 1}/{a.parts}"
    return out


def write_timeline(
    rows: list[tuple[int, str, float, float]],
    path: str | Path,
    plan: StagePlan | None = None,
    devices: Mapping[int, str] | None = None,
) -> None:
    """Chrome-trace JSON of ``(worker, action, start, end)`` rows, and a Gantt PNG if matplotlib is installed.

    Each worker is a thread named ``worker i (device)`` (``devices``: worker to device name), set by
    ``thread_name`` metadata events, so Perfetto labels the rows; each event's ``args`` spell its action
    out (:func:`explain`, with the layers of ``plan``, the plan the rows ran on)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    devices = devices or {}
    workers = {w for w, *_ in rows} | set(devices)
    names = {w: f"worker {w}" + (f" ({devices[w]})" if w in devices else "") for w in workers}
    title = "roundpipe: one measured step" + (f" (plan {plan})" if plan is not None else "")
    events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": title}}]
    for worker in sorted(names):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": worker, "args": {"name": names[worker]}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": worker, "args": {"sort_index": worker}})
    events += [
        {"name": name, "ph": "X", "pid": 0, "tid": worker, "ts": start * 1e6, "dur": (end - start) * 1e6,
         "args": explain(name, plan)}
        for worker, name, start, end in rows
    ]  # fmt: skip
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    colors = {"F": "tab:blue", "L": "tab:purple", "B": "tab:orange"}
    workers = sorted({w for w, *_ in rows})
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(workers) + 1))
    for worker, name, start, end in rows:
        op = name.split(":")[1][0]
        ax.broken_barh([(start * 1e3, (end - start) * 1e3)], (worker - 0.4, 0.8), color=colors.get(op, "gray"))
    ax.set_yticks(workers, [names[w] for w in workers])
    ax.set_xlabel("ms")
    ax.set_title("one measured step (blue: forward, purple: fused, orange: backward)")
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=100)
    plt.close(fig)


class FlushFirst(_Callback):  # type: ignore[misc,valid-type]
    """The pending update into the weights before the other callbacks' epoch ends, validation starts and training
    ends. Without it, Lightning's ``EMAWeightAveraging`` and ``StochasticWeightAveraging`` copied their averages
    into the module while the last update was still landing (on the host), or before the device's values replaced
    the module's (``optimizer_on="device"``): the run ended on the plain weights, not the average. A callback that
    swaps averaged weights in at validation's start had the pending update land on them (5e-2 from plain)."""

    def __init__(self, flush: Any) -> None:
        self._flush = flush

    @override
    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._flush()

    @override
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._flush()  # a callback that swaps averaged weights in for validation (NeMo's EMA) swaps settled ones

    @override
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._flush()
