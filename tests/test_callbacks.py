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
    ):
        assert key in keys, key  # fmt: skip
    assert {float(r["roundpipe/memory_limit_gib"]) for r in rows if r.get("roundpipe/memory_limit_gib")} == {3.0}
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
    trace = json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    assert {e["tid"] for e in trace} == {0, 1} and all(e["dur"] >= 0 for e in trace)


def test_monitor_refuses_a_trainer_without_loggers_or_another_strategy(tmp_path):
    with pytest.raises(Exception, match="logger=False"):
        L.Trainer(strategy="roundpipe", accelerator="cpu", devices=2, logger=False, callbacks=[RoundPipeMonitor()],
                  max_steps=1, enable_progress_bar=False).fit(BoringPipeline(), boring_data())  # fmt: skip
    with pytest.raises(Exception, match="reports on `Trainer\\(strategy='roundpipe'\\)`"):
        trainer = L.Trainer(accelerator="cpu", devices=1, callbacks=[RoundPipeMonitor()], max_steps=1,
                            enable_progress_bar=False, default_root_dir=tmp_path)  # fmt: skip
        trainer.fit(BoringPipeline(), boring_data())


@pytest.mark.parametrize("async_optimizer", [False, True])
def test_monitor_logs_every_steps_gradient_norm_in_both_optimizer_modes(tmp_path, async_optimizer):
    """Synchronously it equals what a user's ``on_before_optimizer_step`` computes from ``p.grad``;
    asynchronously (where that hook sees no gradients) the optimizer thread's, one value per step."""
    logger = L.pytorch.loggers.CSVLogger(tmp_path, name="run")
    L.seed_everything(0, verbose=False)  # the weights (and so the norms) must not depend on the tests before
    module = BoringPipeline()
    trainer = L.Trainer(
        strategy=RoundPipeStrategy(async_optimizer=async_optimizer), accelerator="cpu", devices=2, max_epochs=1,
        log_every_n_steps=50, logger=logger, callbacks=[RoundPipeMonitor()], enable_progress_bar=False,
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
