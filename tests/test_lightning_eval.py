"""validate/test/predict and the validation loop of fit run forward-only through the pipeline."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from helpers import BoringPipeline, boring_data, relative_error

import lightning_roundpipe
from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.engine import PipelineEngine

CPU = dict(
    accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False
)


class MetricPipeline(BoringPipeline):
    """Validation and test log a loss and a torchmetrics metric from the pipeline's outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.val_mse = torchmetrics.MeanSquaredError()
        self.test_mae = torchmetrics.MeanAbsoluteError()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", lightning_roundpipe.pipeline_loss(self.model, x, y, F.mse_loss))
        self.val_mse(lightning_roundpipe.pipeline_forward(self.model, x), y)
        self.log("val_mse", self.val_mse)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.test_mae(lightning_roundpipe.pipeline_forward(self.model, x), y)
        self.log("test_mae", self.test_mae)

    def predict_step(self, batch, batch_idx):
        return lightning_roundpipe.pipeline_forward(self.model, batch[0])


@pytest.fixture
def count_evaluations(monkeypatch):
    calls = []
    original = PipelineEngine.evaluate

    def counted(self, *args, **kwargs):
        calls.append(args[0].shape[0])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(PipelineEngine, "evaluate", counted)
    return calls


@pytest.mark.parametrize("async_optimizer", [False, True])
def test_validate_test_predict_equal_plain_lightning_on_the_same_weights(count_evaluations, async_optimizer):
    L.seed_everything(0, verbose=False)
    module = MetricPipeline()
    strategy = RoundPipeStrategy(num_microbatches=3, async_optimizer=async_optimizer)
    trainer = L.Trainer(strategy=strategy, devices=2, max_epochs=1, limit_val_batches=2, **CPU)
    trainer.fit(module, boring_data(), boring_data(seed=5))
    during_fit = len(count_evaluations)
    assert during_fit == 2 * 2 * 2  # sanity check and one epoch: 2 batches x (loss + outputs)

    plain_module = copy.deepcopy(module)
    data = boring_data(seed=7)
    ours = L.Trainer(strategy=RoundPipeStrategy(num_microbatches=3), devices=2, **CPU)
    plain = L.Trainer(devices=1, **CPU)
    got, want = ours.validate(module, data)[0], plain.validate(plain_module, data)[0]
    for key in ("val_loss", "val_mse"):
        assert got[key] == pytest.approx(want[key], rel=1e-6), key
    assert ours.test(module, data)[0]["test_mae"] == pytest.approx(plain.test(plain_module, data)[0]["test_mae"], 1e-6)
    got_out, want_out = torch.cat(ours.predict(module, data)), torch.cat(plain.predict(plain_module, data))
    assert relative_error(got_out, want_out) <= 1e-6
    assert len(count_evaluations) == during_fit + 2 * 8 + 8 + 8  # everything went through the pipeline


def test_pipeline_forward_in_training_step_says_what_to_use():
    class Wrong(BoringPipeline):
        def training_step(self, batch, batch_idx):
            return F.mse_loss(lightning_roundpipe.pipeline_forward(self.model, batch[0]), batch[1])

    trainer = L.Trainer(strategy=RoundPipeStrategy(num_microbatches=3), devices=2, max_steps=1, **CPU)
    with pytest.raises(RuntimeError, match="pipeline_loss"):
        trainer.fit(Wrong(), boring_data())


def test_standalone_validate_under_inference_mode_with_a_shared_buffer_pool(monkeypatch):
    """trainer.validate runs under torch.inference_mode; buffers the main thread stages go back to a pool
    the workers reuse (the pinned pool on CUDA, emulated here), so they must not be inference tensors."""
    from lightning_roundpipe.runtime import host_pool

    init = host_pool.HostPool.__init__
    monkeypatch.setattr(host_pool.HostPool, "__init__", lambda self, pin: init(self, True))
    monkeypatch.setattr(host_pool.HostPool, "register", lambda self, t: None)
    monkeypatch.setattr(host_pool.HostPool, "close", lambda self: None)
    module = MetricPipeline()
    plain = L.Trainer(devices=1, **CPU).validate(copy.deepcopy(module), boring_data())[0]
    trainer = L.Trainer(strategy=RoundPipeStrategy(num_microbatches=3), devices=1, inference_mode=True, **CPU)
    got = trainer.validate(module, boring_data())[0]
    assert got["val_loss"] == pytest.approx(plain["val_loss"], rel=1e-6)
