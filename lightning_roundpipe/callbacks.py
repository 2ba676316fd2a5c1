"""``RoundPipeMonitor``: what the pipeline is doing, for every worker, through Lightning's loggers.

Like Lightning's ``DeviceStatsMonitor``, it logs every ``log_every_n_steps`` optimizer steps; it asks
the engine to time the next batch shortly before, so measuring costs nothing in between.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import psutil
import torch
from typing_extensions import override

from lightning_roundpipe._flavor import lightning_package
from lightning_roundpipe.runtime.compiles import compilations, compile_seconds

pl = lightning_package(globals())
_Callback = pl.Callback
_MisconfigurationException = pl.utilities.exceptions.MisconfigurationException


class RoundPipeMonitor(_Callback):  # type: ignore[misc,valid-type]
    """Logs per-worker utilisation, the bubble ratio next to the simulator's prediction, transfer
    bandwidth and memory; writes the layer costs the plan was made from, and a timeline of one step.

    Logged keys:

    - ``roundpipe/busy_worker{i}``: fraction of the measured step worker ``i``'s device computed
    - ``roundpipe/bubble_measured``: ``1 - mean(busy)``
    - ``roundpipe/bubble_predicted``: the simulator's bubble ratio for the current plan, measured
      layer costs and measured handoff between batches (after the automatic plan was made)
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
    - ``roundpipe/drift``: at the engine's last drift check, how far stage times moved from those the
      automatic plan first measured (relative to its slowest stage); past ``replan_margin`` twice in
      a row the layers are measured again
    - ``roundpipe/h2d_gbps``, ``roundpipe/d2h_gbps``: host-to-device and device-to-host bandwidth
      since the previous log
    - ``roundpipe/gpu_memory_gib_worker{i}``: memory in use on worker ``i``'s GPU (NVML)
    - ``roundpipe/host_rss_gib``: resident memory of this process
    - ``roundpipe/grad_norm``: the global 2-norm of every optimizer step's gradients before clipping
      (``grad_norm=True``). Synchronously from the gradients Lightning's hooks see; asynchronously the
      optimizer thread computes it where the gradients are (``on_before_optimizer_step`` sees none in
      that mode), and it is logged under its own step once that step's update ran (a step later)

    Args:
        timeline: a path; the first measured step is written there as Chrome-trace JSON (open it in
            Perfetto), with a Gantt chart next to it as PNG when matplotlib is installed.
        layer_costs: a path for the measured per-layer costs (JSON), written whenever a plan is made.
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
        self._written_costs: Any = None
        self._nvml: Any = None

    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        if not trainer.loggers:
            raise _MisconfigurationException("Cannot use `RoundPipeMonitor` callback with `Trainer(logger=False)`.")
        if getattr(trainer.strategy, "strategy_name", None) != "roundpipe":
            raise _MisconfigurationException(
                f"`RoundPipeMonitor` reports on `Trainer(strategy='roundpipe')`; this Trainer uses"
                f" {type(trainer.strategy).__name__}."
            )
        trainer.strategy.measure_grad_norm = self.grad_norm

    @override
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        """Synchronous mode: the step's gradients are in ``p.grad`` here, unscaled and not yet clipped."""
        if not self.grad_norm or trainer.strategy.async_optimizer:
            return
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        self._log(trainer, {"roundpipe/grad_norm": norm}, trainer.fit_loop.epoch_loop._batches_that_stepped)

    def _log_async_grad_norm(self, trainer: Any, engine: Any) -> None:
        """The norms of the updates the optimizer thread ran since the last call, each under its own step."""
        if not self.grad_norm or engine.crew.optimizer is None:
            return
        for step, norm in list(engine.crew.optimizer.grad_norms):
            if step > self._norm_logged:
                self._norm_logged = step
                self._log(trainer, {"roundpipe/grad_norm": norm}, step)

    @staticmethod
    def _log(trainer: Any, metrics: dict[str, float], step: int) -> None:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    @override
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        engine = trainer.strategy.engine
        if engine is not None and engine.crew.optimizer is not None and self.grad_norm:
            engine.flush()  # the last step's update (and its norm)
            self._log_async_grad_norm(trainer, engine)

    def _due(self, trainer: Any, ahead: int) -> bool:
        return (trainer.global_step + ahead) % max(1, trainer.log_every_n_steps) == 0

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
        if (
            self.layer_costs is not None
            and engine.planner.layer_costs is not None
            and engine.planner.layer_costs is not self._written_costs
        ):
            self._written_costs = engine.planner.layer_costs
            self._write_costs(engine)
        if self.timeline is not None and not self.timeline.exists() and engine.stats.last_timeline:
            write_timeline(engine.stats.last_timeline, self.timeline)
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
        if engine.planner.predicted_bubble is not None:
            metrics["roundpipe/bubble_predicted"] = engine.planner.predicted_bubble
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
            "predicted_bubble": engine.planner.predicted_bubble,
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


def write_timeline(rows: list[tuple[int, str, float, float]], path: str | Path) -> None:
    """Chrome-trace JSON of ``(worker, action, start, end)`` rows, and a Gantt PNG if matplotlib is installed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    events = [
        {"name": name, "ph": "X", "pid": 0, "tid": worker, "ts": start * 1e6, "dur": (end - start) * 1e6}
        for worker, name, start, end in rows
    ]
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
    ax.set_yticks(workers, [f"worker {w}" for w in workers])
    ax.set_xlabel("ms")
    ax.set_title("one measured step (blue: forward, purple: fused, orange: backward)")
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=100)
    plt.close(fig)
