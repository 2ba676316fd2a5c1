"""``RoundPipeMonitor`` logs per-worker numbers, writes layer costs and a timeline."""

from __future__ import annotations

import csv
import json

import lightning as L
import pytest
from helpers import BoringPipeline, boring_data

from lightning_roundpipe import RoundPipeMonitor, RoundPipeStrategy


def test_monitor_logs_and_writes_files(tmp_path, monkeypatch):
    import lightning_roundpipe.build

    monkeypatch.setattr(lightning_roundpipe.build, "device_memory_limit", lambda *a: 3 * 2**30)  # a GPU's limit
    monitor = RoundPipeMonitor(timeline=tmp_path / "timeline.json", layer_costs=tmp_path / "costs.json")
    logger = L.pytorch.loggers.CSVLogger(tmp_path, name="run")
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        strategy=RoundPipeStrategy(num_microbatches=3, profile_steps=2, check_every=2, replan_margin=10.0),
        accelerator="cpu", devices=2,
        max_epochs=2, log_every_n_steps=2, logger=logger, callbacks=[monitor], enable_progress_bar=False,
        enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(BoringPipeline(), boring_data())
    with open(logger.log_dir + "/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    keys = set().union(*(r.keys() for r in rows))
    for key in (
        "roundpipe/busy_worker0",
        "roundpipe/busy_worker1",
        "roundpipe/bubble_measured",
        "roundpipe/bubble_predicted",
        "roundpipe/stages",
        "roundpipe/recovered_batches",
        "roundpipe/h2d_gbps",
        "roundpipe/host_rss_gib",
        "roundpipe/drift",
        "roundpipe/host_step_s",
        "roundpipe/wait_inputs_s",  # the workers' blocked seconds per batch, by reason
        "roundpipe/wait_launch_s",
        "roundpipe/memory_limit_gib",
        "roundpipe/cache_releases",
    ):
        assert key in keys, key  # fmt: skip
    assert {float(r["roundpipe/memory_limit_gib"]) for r in rows if r.get("roundpipe/memory_limit_gib")} == {3.0}
    assert {float(r["roundpipe/cache_releases"]) for r in rows if r.get("roundpipe/cache_releases")} == {0.0}  # CPU
    measured = [float(r["roundpipe/bubble_measured"]) for r in rows if r.get("roundpipe/bubble_measured")]
    assert measured and all(0 <= b < 1 for b in measured)
    split = [r for r in rows if r.get("roundpipe/bubble_in_step") and r.get("roundpipe/host_gap")]
    assert split
    for r in split:  # busy/period = busy/span x span/period: the two parts make up the measured bubble
        in_step, gap = float(r["roundpipe/bubble_in_step"]), float(r["roundpipe/host_gap"])
        assert 0 <= in_step < 1 and 0 <= gap < 1
        if gap > 0:
            assert 1 - float(r["roundpipe/bubble_measured"]) == pytest.approx((1 - in_step) * (1 - gap), abs=0.02)
    costs = json.loads((tmp_path / "costs.json").read_text())
    assert len(costs["layers"]) == 9 and costs["plan"]
    trace = [e for e in json.loads((tmp_path / "timeline.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in trace} == {0, 1} and all(e["dur"] >= 0 for e in trace)


def test_monitor_refuses_a_trainer_without_loggers_or_another_strategy(tmp_path):
    """Without a logger and without files to write it would produce nothing."""
    with pytest.raises(Exception, match=r"logger=False.*timeline=.*layer_costs="):
        L.Trainer(strategy="roundpipe", accelerator="cpu", devices=2, logger=False, callbacks=[RoundPipeMonitor()],
                  max_steps=1, enable_progress_bar=False).fit(BoringPipeline(), boring_data())  # fmt: skip
    with pytest.raises(Exception, match="reports on `Trainer\\(strategy='roundpipe'\\)`"):
        trainer = L.Trainer(accelerator="cpu", devices=1, callbacks=[RoundPipeMonitor()], max_steps=1,
                            enable_progress_bar=False, default_root_dir=tmp_path)  # fmt: skip
        trainer.fit(BoringPipeline(), boring_data())


@pytest.mark.parametrize("async_optimizer", [False, True])
def test_monitor_logs_every_steps_gradient_norm_in_both_optimizer_modes(tmp_path, async_optimizer):
    """Synchronously it equals what a user's ``on_before_optimizer_step`` computes from ``p.grad``;
    asynchronously (where that hook sees no gradients) the optimizer thread's, one value per step
    (``log_every_n_steps=1``: every step is a logging step)."""
    logger = L.pytorch.loggers.CSVLogger(tmp_path, name="run")
    L.seed_everything(0, verbose=False)  # the weights (and so the norms) must not depend on the tests before
    module = BoringPipeline()
    trainer = L.Trainer(
        strategy=RoundPipeStrategy(async_optimizer=async_optimizer), accelerator="cpu", devices=2, max_epochs=1,
        log_every_n_steps=1, logger=logger, callbacks=[RoundPipeMonitor()], enable_progress_bar=False,
        enable_checkpointing=False, gradient_clip_val=0.1,
    )  # fmt: skip
    trainer.fit(module, boring_data())
    with open(logger.log_dir + "/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("roundpipe/grad_norm")]
    norms = {int(r["step"]): float(r["roundpipe/grad_norm"]) for r in rows}
    assert sorted(norms) == list(range(trainer.global_step))  # every step, under its own number
    assert all(n > 0.1 for n in norms.values())  # before clipping (the clip is 0.1)
    if not async_optimizer:
        assert [norms[k] for k in sorted(norms)] == pytest.approx(module.seen_grad_norms, rel=1e-5)


class _PlanSpy(L.Callback):
    """Measures the layers again before step 10 (as two drifts would), and notes, when the monitor logs,
    whether the plan was known and its handoff measured."""

    def __init__(self) -> None:
        self.known: dict[int, bool] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 10:
            trainer.strategy.engine.planner.replan()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        engine = trainer.strategy.engine
        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        self.known[step] = not engine.planner.measuring and engine.stats.handoff is not None


def test_predicted_bubble_is_logged_only_once_it_charges_the_measured_handoff(tmp_path):
    """Issue 41: ``bubble_predicted`` read 0.0 beside a measured bubble. On one worker the schedule
    itself leaves none; what the simulator adds is the handoff between batches, measured on the plan's
    first recorded batches. Before that (a plan just made, and again after the layers were measured
    anew) the prediction charged no handoff and read exactly 0.0: nothing is logged then. Synchronously
    the whole handoff follows the batch, so a known prediction is above 0."""
    logger = L.pytorch.loggers.CSVLogger(tmp_path, name="run")
    L.seed_everything(0, verbose=False)
    spy = _PlanSpy()
    trainer = L.Trainer(
        strategy=RoundPipeStrategy(async_optimizer=False, num_microbatches=2, profile_steps=2), accelerator="cpu",
        devices=1, max_epochs=2, log_every_n_steps=2, logger=logger, callbacks=[RoundPipeMonitor(), spy],
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(BoringPipeline(), boring_data())
    with open(logger.log_dir + "/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("roundpipe/stages")]
    assert len(rows) == 8 and 0 < sum(spy.known[int(r["step"])] for r in rows) < 8  # both cases happened
    for r in rows:
        if spy.known[int(r["step"])]:
            assert float(r["roundpipe/bubble_predicted"]) > 0 and float(r["roundpipe/handoff_s"]) > 0, r
        else:
            assert not r.get("roundpipe/bubble_predicted"), r


@pytest.mark.parametrize("async_optimizer", [False, True])
def test_gradient_norm_is_logged_at_lightnings_logging_frequency(tmp_path, async_optimizer):
    """Issue 41: with ``log_every_n_steps=4`` the norm was logged at every step (most CSV rows held
    only it); now under the same steps as Lightning's own metrics (``train_loss``)."""
    logger = L.pytorch.loggers.CSVLogger(tmp_path, name="run")
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        strategy=RoundPipeStrategy(async_optimizer=async_optimizer), accelerator="cpu", devices=2, max_epochs=1,
        log_every_n_steps=4, logger=logger, callbacks=[RoundPipeMonitor()], enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(BoringPipeline(), boring_data())  # 8 steps
    with open(logger.log_dir + "/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    norm_steps = [int(r["step"]) for r in rows if r.get("roundpipe/grad_norm")]
    assert norm_steps == [3, 7]
    assert set(norm_steps) == {int(r["step"]) for r in rows if r.get("train_loss")}
    assert len(rows) <= 3 * len(norm_steps)  # Lightning's row, the monitor's metrics, the norm: per logging step


def test_monitor_without_a_logger_still_writes_its_files(tmp_path):
    """Issue 41: ``Trainer(logger=False)`` was refused even when only the timeline and the layer costs
    were asked for. Now they are written; only metrics need a logger."""
    monitor = RoundPipeMonitor(timeline=tmp_path / "timeline.json", layer_costs=tmp_path / "costs.json")
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        strategy=RoundPipeStrategy(num_microbatches=3, profile_steps=2), accelerator="cpu", devices=2, max_steps=6,
        logger=False, callbacks=[monitor], enable_progress_bar=False, enable_checkpointing=False,
        enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(BoringPipeline(), boring_data())
    assert json.loads((tmp_path / "costs.json").read_text())["plan"]
    assert json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    assert not trainer.strategy.measure_grad_norm  # no logger to take the norms: no pass over the gradients


def test_timeline_names_its_threads_and_spells_out_each_action(tmp_path):
    """Issue 41: the trace's threads were unnamed and ``0:F0.0`` explained nowhere. Each worker's thread
    is named (Chrome trace metadata) and each event's ``args`` say what it is."""
    from lightning_roundpipe.schedule.plan import StagePlan

    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        strategy=RoundPipeStrategy(plan="4,4|1,4,4", num_microbatches=4), accelerator="cpu", devices=2, max_steps=3,
        callbacks=[RoundPipeMonitor(timeline=tmp_path / "timeline.json")], enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(BoringPipeline(), boring_data())
    trace = json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in trace if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {0: "worker 0 (cpu)", 1: "worker 1 (cpu)"}
    events = [e for e in trace if e["ph"] == "X"]
    stages = StagePlan.parse("4,4|1,4,4").stages()
    ops = {"F": "forward", "L": "fused", "B": "backward"}
    assert {e["name"].split(":")[1][0] for e in events} == set(ops)
    for e in events:
        rnd, rest = e["name"].split(":")
        slot, microbatch = rest[1:].split(".")
        stage = stages[int(slot)]
        assert e["args"] == {
            "round": int(rnd), "op": ops[rest[0]], "slot": int(slot), "microbatch": int(microbatch),
            "layers": list(stage.layers),
        }  # fmt: skip


class _EpochAverage(L.pytorch.callbacks.WeightAveraging):
    """An average of the weights at each epoch's end (deterministic: no update lands meanwhile)."""

    def should_update(self, step_idx=None, epoch_idx=None):
        return epoch_idx is not None


@pytest.mark.timeout(180)
@pytest.mark.parametrize("make", [_EpochAverage, lambda: L.pytorch.callbacks.StochasticWeightAveraging(1e-2, 1)])
def test_weight_averaging_callbacks_end_on_the_average_with_the_states_on_the_host_or_the_device(make):
    """Lightning calls the callbacks' ``on_train_end`` before the strategy's: the average was copied into the module
    before the last update landed (host) or before the device's values replaced it (optimizer_on='device', which
    'auto' picks on one GPU: the run ended on the plain weights, 12-22% away). The strategy's first callback lands
    the pending update before any other's epoch and training end."""
    import torch
    from helpers import fit, flat_weights, relative_error

    runs = {}
    for place in ("host", "device", None):
        strategy = RoundPipeStrategy(num_microbatches=2, optimizer_on=place or "host")
        callbacks = [make()] if place else []
        module = fit(BoringPipeline, {"accelerator": "cpu", "devices": 1, "max_epochs": 3, "callbacks": callbacks,
                                      "strategy": strategy})  # fmt: skip
        runs[place] = flat_weights(module)
        assert not any(type(c).__name__ == "FlushFirst" for c in module.trainer.callbacks)  # gone after the fit
    assert torch.equal(runs["device"], runs["host"])
    assert relative_error(runs["host"], runs[None]) > 0.05  # the average, not the last weights


class _SwapForValidation(L.Callback):
    """An average of the weights swapped in for validation and back after it (NeMo's EMA callback does this)."""

    def __init__(self) -> None:
        self.average = None

    def on_train_batch_end(self, trainer, module, *args):
        weights = [p.detach() for p in module.parameters()]
        if self.average is None:
            self.average = [w.clone() for w in weights]
        for a, w in zip(self.average, weights):
            a.mul_(0.5).add_(w, alpha=0.5)

    def _swap(self, module):
        for a, p in zip(self.average or (), module.parameters()):
            held = p.detach().clone()
            p.detach().copy_(a)
            a.copy_(held)

    def on_validation_start(self, trainer, module):
        self._swap(module)

    def on_validation_end(self, trainer, module):
        self._swap(module)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("optimizer_on", ["host", "device", 0.5])
def test_weights_swapped_in_for_validation_do_not_take_the_pending_update(optimizer_on):
    """Callbacks' ``on_validation_start`` runs before the strategy's, which flushed: the pending update landed on
    the swapped-in average (host), or the device's masters replaced it (device), and training went on from a mix
    (5e-2 from the run without the swap). Plain Lightning trains the same weights with or without it. The count of
    micro-batches is given: one chosen with the plan depends on the measured times (3 or 1, 5e-8 apart)."""
    import torch
    from helpers import flat_weights

    runs = []
    for callbacks in ([], [_SwapForValidation()]):
        L.seed_everything(1, verbose=False)
        module = BoringPipeline()
        L.Trainer(
            max_epochs=2, val_check_interval=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, accelerator="cpu", devices=1, callbacks=callbacks,
            strategy=RoundPipeStrategy(num_microbatches=2, optimizer_on=optimizer_on),
        ).fit(module, boring_data(), boring_data(24))  # fmt: skip
        runs.append(flat_weights(module))
    assert torch.equal(runs[0], runs[1])
