"""Checkpoints: k steps, save, resume, k more equals 2k uninterrupted; saving is atomic."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import BoringPipeline, boring_data, flat_weights, relative_error
from torch import nn

import lightning_roundpipe
from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.checkpoint_io import StreamingCheckpointIO
from lightning_roundpipe.runtime.one_pass import OnePass


class DropoutPipeline(BoringPipeline):
    """Dropout between the layers, a step-wise LR schedule: resuming must restore seeds and the scheduler."""

    def __init__(self) -> None:
        super().__init__(scheduler=True, lr=3e-2)
        self.model = nn.Sequential(
            nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 16), nn.GELU(), nn.Dropout(0.2),
            nn.Linear(16, 4),
        )  # fmt: skip

    def training_step(self, batch, batch_idx):
        x, y = batch
        return lightning_roundpipe.pipeline_loss(self.model, x, y, F.mse_loss)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def run(module_cls, strategy_kwargs, epochs: int, tmp: Path, ckpt: str | None = None) -> L.LightningModule:
    L.seed_everything(1, verbose=False)
    module = module_cls()
    trainer = L.Trainer(
        strategy=RoundPipeStrategy(num_microbatches=3, **strategy_kwargs), accelerator="cpu", devices=2,
        max_epochs=epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp, filename="{epoch}", save_top_k=-1)],
    )  # fmt: skip
    trainer.fit(module, boring_data(), ckpt_path=ckpt)
    return module


@pytest.mark.parametrize(
    "module_cls, strategy_kwargs",
    [
        (DropoutPipeline, dict(async_optimizer=False, plan="2,2|3,2,2")),
        (DropoutPipeline, dict(async_optimizer=False)),  # automatic plan: profiled, then kept on resume
        (BoringPipeline, dict(async_optimizer=True, plan="3,2|4,2,3")),  # an update is pending at the save
        (BoringPipeline, dict(async_optimizer=True)),
    ],
)
def test_resume_equals_uninterrupted_training(tmp_path, module_cls, strategy_kwargs):
    straight = run(module_cls, strategy_kwargs, 2, tmp_path / "straight")
    run(module_cls, strategy_kwargs, 1, tmp_path / "first")
    checkpoint = tmp_path / "first" / "epoch=0.ckpt"
    state = torch.load(checkpoint, weights_only=False)["roundpipe"]
    assert state["calls"] == 8 and ("compute" in state) == strategy_kwargs["async_optimizer"]
    resumed = run(module_cls, strategy_kwargs, 2, tmp_path / "resumed", ckpt=str(checkpoint))
    assert relative_error(flat_weights(resumed), flat_weights(straight)) <= 1e-6
    if strategy_kwargs.get("plan") is None:  # the plan in use at the save is the one resumed with
        assert state["plan"] != "1|1,1,1,1,1,1,1,1,1" and state["layer_costs"] is not None


def test_async_checkpoint_refuses_a_synchronous_resume(tmp_path):
    run(BoringPipeline, dict(async_optimizer=True), 1, tmp_path)
    with pytest.raises(ValueError, match="async_optimizer=True"):
        run(BoringPipeline, dict(async_optimizer=False), 2, tmp_path, ckpt=str(tmp_path / "epoch=0.ckpt"))


def test_a_crash_while_saving_leaves_the_last_checkpoint_whole(tmp_path, monkeypatch):
    io = StreamingCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"weights": torch.arange(10.0)}, path)

    def crash(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt  # the process is being killed mid-write

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"weights": torch.zeros(10)}, path)
    monkeypatch.undo()
    assert torch.equal(io.load_checkpoint(path)["weights"], torch.arange(10.0))
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temporary file left behind


def test_strategy_writes_through_the_streaming_io_by_default():
    assert isinstance(RoundPipeStrategy().checkpoint_io, StreamingCheckpointIO)


def test_a_checkpoint_io_plugin_goes_with_a_strategy_instance():
    """The default is made when first asked for: Lightning refuses a CheckpointIO set on both (a
    regression of the glue split, found in review)."""
    from lightning.pytorch.plugins import TorchCheckpointIO

    trainer = L.Trainer(strategy=RoundPipeStrategy(), plugins=[TorchCheckpointIO()], accelerator="cpu", logger=False)
    assert type(trainer.strategy.checkpoint_io) is TorchCheckpointIO


def test_checkpoint_state_dict_loads_into_the_plain_model(tmp_path):
    trained = run(BoringPipeline, dict(async_optimizer=True), 1, tmp_path)
    state = torch.load(tmp_path / "epoch=0.ckpt", weights_only=False)["state_dict"]
    plain = BoringPipeline()
    plain.load_state_dict(state, strict=True)
    assert torch.equal(flat_weights(plain), flat_weights(trained))


def test_async_checkpoint_saved_during_validation_resumes_exactly(tmp_path):
    """ModelCheckpoint saves in on_validation_end (here every second epoch), while the compute copies hold
    the masters for evaluation: the checkpoint must keep the ones set aside for the next step."""

    def run(directory, epochs, ckpt=None):
        L.seed_everything(1, verbose=False)
        module = BoringPipeline()
        trainer = L.Trainer(
            strategy=RoundPipeStrategy(num_microbatches=3, async_optimizer=True, plan="3,2|4,2,3"),
            accelerator="cpu", devices=2, max_epochs=epochs, logger=False, enable_progress_bar=False,
            enable_model_summary=False, check_val_every_n_epoch=2, num_sanity_val_steps=0,
            callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=directory, filename="{epoch}", save_top_k=-1)],
        )  # fmt: skip
        trainer.fit(module, boring_data(), boring_data(24), ckpt_path=ckpt)
        return module

    straight = run(tmp_path / "a", 4)
    resumed = run(tmp_path / "b", 4, ckpt=str(tmp_path / "a" / "epoch=1.ckpt"))
    assert relative_error(flat_weights(resumed), flat_weights(straight)) <= 1e-6


@pytest.mark.parametrize("buffering", [True, "first"])
def test_double_buffered_resume_at_an_odd_step_equals_uninterrupted_and_either_buffering(
    tmp_path, monkeypatch, buffering
):
    """9 batches per epoch: the save falls on an odd step, whose batches read the spare copies. With every group
    double-buffered, AdamW's math and the cast run in one pass (runtime/one_pass.py), rounded as the C++ kernel
    rounds: the same numbers as without spares to rounding, and bit for bit with that kernel off."""

    def run(directory, epochs, ckpt=None, double_buffer=buffering):
        L.seed_everything(1, verbose=False)
        module = BoringPipeline()
        strategy = RoundPipeStrategy(num_microbatches=3, plan="3,2|4,2,3", double_buffer=double_buffer)
        trainer = L.Trainer(
            strategy=strategy, accelerator="cpu", devices=2, max_epochs=epochs, logger=False,
            enable_progress_bar=False, enable_model_summary=False,
            callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=directory, filename="{epoch}", save_top_k=-1)],
        )  # fmt: skip
        trainer.fit(module, boring_data(108), ckpt_path=ckpt)
        return module

    straight = run(tmp_path / "a", 2)
    state = torch.load(tmp_path / "a" / "epoch=0.ckpt", weights_only=False)["roundpipe"]
    assert state["step"] % 2 == 1 and "compute" in state
    resumed = run(tmp_path / "b", 2, ckpt=str(tmp_path / "a" / "epoch=0.ckpt"))
    assert relative_error(flat_weights(resumed), flat_weights(straight)) <= 1e-6
    single = run(tmp_path / "c", 2, double_buffer=False)
    assert relative_error(flat_weights(single), flat_weights(straight)) <= 1e-6
    if buffering == "first":  # some groups spared, and their timing is the plan's: torch's AdamW for all
        assert torch.equal(flat_weights(single), flat_weights(straight))  # the same numbers, only earlier casts
    else:
        with monkeypatch.context() as m:
            m.setattr(OnePass, "enabled", False)
            assert torch.equal(flat_weights(run(tmp_path / "g", 2)), flat_weights(single))
    # a checkpoint carries the copy the next step reads, whichever way it was kept: resumable either way
    switched = run(tmp_path / "d", 2, ckpt=str(tmp_path / "a" / "epoch=0.ckpt"), double_buffer=False)
    assert relative_error(flat_weights(switched), flat_weights(straight)) <= 1e-6
    run(tmp_path / "e", 1, double_buffer=False)
    back = run(tmp_path / "f", 2, ckpt=str(tmp_path / "e" / "epoch=0.ckpt"))
    assert relative_error(flat_weights(back), flat_weights(straight)) <= 1e-6


def test_double_buffer_needs_the_asynchronous_optimizer():
    with pytest.raises(ValueError, match="async_optimizer=True"):
        RoundPipeStrategy(async_optimizer=False, double_buffer=True)
    with pytest.raises(ValueError, match=r"must be .all. \(or True\), .first., .auto. or .none."):
        RoundPipeStrategy(double_buffer="both")


def test_checkpoint_files_follow_the_umask_as_plain_lightnings_do(tmp_path):
    """The temporary file a streamed checkpoint is written through is private (0600); the checkpoint takes the
    mode a plain open() gives (0644 under the usual umask 022), as Lightning's own writer does."""
    import os

    from lightning_roundpipe.checkpoint_io import StreamingCheckpointIO

    old = os.umask(0o022)
    try:
        StreamingCheckpointIO().save_checkpoint({"x": torch.zeros(2)}, tmp_path / "a.ckpt")
        os.umask(0o027)
        StreamingCheckpointIO().save_checkpoint({"x": torch.zeros(2)}, tmp_path / "b.ckpt")
    finally:
        os.umask(old)
    assert (tmp_path / "a.ckpt").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "b.ckpt").stat().st_mode & 0o777 == 0o640


class _Tunable(BoringPipeline):
    def __init__(self) -> None:
        super().__init__()
        self.learning_rate = 1e-3

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.learning_rate)


@pytest.mark.timeout(180)
def test_the_learning_rate_finder_restores_the_run_and_the_fit_after_it_equals_plain_lightnings():
    """Lightning's learning-rate finder saves a checkpoint, runs trial steps, then loads the checkpoint into the same
    fit: the engine, which had run batches, refused its state ('load the roundpipe engine state before the first
    batch'). A new engine takes it now, as at a resume."""
    from lightning.pytorch.tuner import Tuner

    def run(strategy):
        L.seed_everything(1, verbose=False)
        module = _Tunable()
        before = flat_weights(module).clone()
        trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            **({} if strategy is None else {"strategy": strategy}))  # fmt: skip
        found = Tuner(trainer).lr_find(module, train_dataloaders=boring_data(samples=480), num_training=12)
        assert torch.equal(flat_weights(module), before)  # the trial steps were undone
        trainer.fit(module, boring_data())
        return found.suggestion(), flat_weights(module)

    plain = run(None)
    ours = run(RoundPipeStrategy(num_microbatches=2, async_optimizer=False))
    assert ours[0] == plain[0] and relative_error(ours[1], plain[1]) <= 1e-5
    for place in ("host", "device"):  # the asynchronous optimizer, its states on the host or the device: restored
        run(RoundPipeStrategy(num_microbatches=2, optimizer_on=place))
