"""Update casts through a device (``casts="device"``): the same weights as the optimizer thread's own casts.

On CPU workers a thread stands in for the device and copies late, so that a cast gate opened before its copy
landed, or a master changed before the device read it, shows as different weights."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import BoringPipeline, boring_data, fit, flat_weights
from torch import nn

from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.engine import PipelineEngine
from lightning_roundpipe.runtime import WorkerDevice
from lightning_roundpipe.runtime import optimizer_worker as optimizer_module
from lightning_roundpipe.runtime import update_casts as casts_module
from lightning_roundpipe.runtime.device import CudaWorkerDevice
from lightning_roundpipe.runtime.host_store import HostStore
from lightning_roundpipe.runtime.optimizer_worker import UpdateSpec
from lightning_roundpipe.schedule import StagePlan


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3)
    )


def train(
    model: nn.Module, devices: list, steps: int = 6, per_step: int = 2, evaluate_at: tuple[int, ...] = (), **kwargs
) -> torch.Tensor:
    """The weights after ``steps`` steps (and, after each step in ``evaluate_at``, a forward-only pass's outputs)."""
    engine = PipelineEngine(
        list(model.children()), devices, asynchronous=True, compute_dtype=torch.bfloat16,
        autocast_dtype=torch.bfloat16, **kwargs,
    )  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    g = torch.Generator().manual_seed(3)
    outputs = []
    try:
        for step in range(steps):
            for i in range(per_step):
                x, y = torch.randn(12, 6, generator=g), torch.randn(12, 3, generator=g)
                engine.train_batch(x, y, F.mse_loss, grad_scale=1.0 / per_step, last_of_step=i == per_step - 1)
            engine.submit_step(UpdateSpec.capture(opt))
            if step in evaluate_at:
                engine.begin_evaluation()
                outputs.append(engine.evaluate(torch.randn(12, 6, generator=g)).flatten().float())
                engine.end_evaluation()
        engine.flush()
    finally:
        engine.close()
    return torch.cat([flat_weights(model), *outputs])


class CountingCaster(casts_module.ThreadCaster):
    """Late copies (15 ms after queueing), counted."""

    delay = 0.015
    issued = 0

    def run(self, dst, src, read):
        CountingCaster.issued += 1
        super().run(dst, src, read)


class SlowCaster(casts_module.ThreadCaster):
    delay = 0.06  # longer than a step of the small model: casts still land after the next step's math


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "kwargs",
    [
        {"microbatches_per_round": 2},
        {"microbatches_per_round": 3, "num_rounds": 2, "plan": StagePlan.parse("2,2,1|2,1,2,2")},
        {"microbatches_per_round": 2, "double_buffer": True},
        {"microbatches_per_round": 2, "double_buffer": "first", "plan": "auto", "profile_steps": 1},
        {"microbatches_per_round": 2, "consistency": "barrier"},
        {"microbatches_per_round": 2, "evaluate_at": (1, 2, 4)},  # forward-only passes between steps
    ],
)
def test_late_device_casts_give_the_host_casts_weights(monkeypatch, kwargs):
    model = mlp()
    workers = 3 if kwargs.get("num_rounds") else 2
    host = train(copy.deepcopy(model), [WorkerDevice("cpu", i) for i in range(workers)], **kwargs)
    monkeypatch.setattr(casts_module, "ThreadCaster", CountingCaster)
    CountingCaster.issued = 0
    device = train(copy.deepcopy(model), [WorkerDevice("cpu", i) for i in range(workers)], casts="device", **kwargs)
    assert torch.equal(device, host)
    trainable_groups = 4  # weight and bias of each linear share a group (one dtype a layer)
    if kwargs.get("consistency") == "barrier":
        assert CountingCaster.issued == 0  # the engine casts at the barrier itself, on the host
    else:
        assert CountingCaster.issued >= trainable_groups * 5  # every update but the last's pending ones


@pytest.mark.timeout(120)
def test_flush_leaves_no_cast_in_flight(monkeypatch):
    """``flush`` promises every update reached the masters and every earlier update its compute copies, as the
    host's casts do (evaluation and checkpoints set the copies aside and back): a cast landing later would
    overwrite them."""
    landed, started = [], []

    class Counted(SlowCaster):
        def run(self, dst, src, read):
            started.append(1)
            super().run(dst, src, read)
            landed.append(1)

    monkeypatch.setattr(casts_module, "ThreadCaster", Counted)
    model = mlp()
    engine = PipelineEngine(
        list(model.children()), [WorkerDevice("cpu", i) for i in range(2)], asynchronous=True, casts="device",
        compute_dtype=torch.bfloat16, autocast_dtype=torch.bfloat16, microbatches_per_round=2,
    )  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    try:
        for _ in range(3):
            engine.train_batch(torch.randn(12, 6), torch.randn(12, 3), F.mse_loss, last_of_step=True)
            engine.submit_step(UpdateSpec.capture(opt))
            engine.flush()
            assert len(landed) == len(started)
        assert len(started) == 2 * 4  # the first two updates' casts; the third's wait for the next step
    finally:
        engine.close()


def test_a_failing_device_cast_reaches_the_main_thread_and_opens_its_gate(monkeypatch):
    class Broken(casts_module.ThreadCaster):
        def run(self, dst, src, read):
            raise RuntimeError("cast failed on the device")

    monkeypatch.setattr(casts_module, "ThreadCaster", Broken)
    with pytest.raises(RuntimeError, match="cast failed on the device"):
        train(mlp(), [WorkerDevice("cpu", 0)], steps=4, per_step=1, casts="device")


def test_casts_that_keep_the_dtype_stay_on_the_host():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.BatchNorm1d(2))
    model[1].requires_grad_(False)
    mixed, same = HostStore(list(model), torch.bfloat16, separate_compute=True), HostStore(list(model), None, True)
    assert [casts_module.UpdateCasts.takes(g) for g in mixed.groups] == [g.trainable for g in mixed.groups]
    assert sum(g.trainable for g in mixed.groups) == 2 and len(mixed.groups) > 3  # frozen and buffers stay
    assert not any(casts_module.UpdateCasts.takes(g) for g in same.groups)


def test_the_option_is_checked():
    with pytest.raises(ValueError, match="cast_updates='gpu'"):
        RoundPipeStrategy(cast_updates="gpu")
    with pytest.raises(ValueError, match="needs async_optimizer=True"):
        RoundPipeStrategy(cast_updates="device", async_optimizer=False)
    with pytest.raises(ValueError, match="casts='gpu'"):
        PipelineEngine(list(mlp().children()), [WorkerDevice("cpu", 0)], asynchronous=True, casts="gpu")
    with pytest.raises(ValueError, match="asynchronous=True"):
        PipelineEngine(list(mlp().children()), [WorkerDevice("cpu", 0)], casts="device")


@pytest.mark.timeout(30)
def test_the_casts_thread_outlives_a_failing_report():
    """Whatever reporting an error does, the thread goes on: the optimizer thread and ``flush`` wait on it."""

    def report(error: BaseException) -> None:
        raise RuntimeError("the report itself failed")

    class Broken(casts_module.ThreadCaster):
        def run(self, dst, src, read):
            raise ValueError("cast failed")

    casts = casts_module.UpdateCasts([torch.device("cpu")], report)
    casts._casters = [Broken()]
    src, dst, landed = torch.ones(4), torch.zeros(4, dtype=torch.bfloat16), []
    casts.cast(0, dst, src, lambda: landed.append(0))
    casts.before_write(0)  # returns: the read is marked done even though the cast failed
    casts._casters = [casts_module.ThreadCaster()]
    casts.cast(1, dst, src, lambda: landed.append(1))
    casts.before_write(1)
    assert casts.close() and landed == [0, 1] and torch.equal(dst, src.to(torch.bfloat16))
    assert [type(e) for e in casts.errors] == [ValueError, RuntimeError]


@pytest.mark.timeout(60)
def test_device_casts_go_shallow_first_once_their_copies_are_free(monkeypatch):
    """One worker, every layer in one fused stage: each group is uploaded once, at the step's start, so all of an
    update's casts are free together and go in the order the next forward reads them; the host's own casts keep
    the update's order (deep first)."""
    order: list[int] = []

    class Recording(casts_module.ThreadCaster):
        def run(self, dst, src, read):
            order.append(src.numel())
            super().run(dst, src, read)

    monkeypatch.setattr(casts_module, "ThreadCaster", Recording)
    cast_after = optimizer_module.OptimizerWorker._cast_after

    def when_all_free(self, job, groups, flights):  # the next step's uploads done first: no race in the test
        for flight in flights:
            for g in groups:
                flight.wait_uploaded(g)
        cast_after(self, job, groups, flights)

    monkeypatch.setattr(optimizer_module.OptimizerWorker, "_cast_after", when_all_free)
    model = mlp()
    sizes = [layer.weight.numel() + layer.bias.numel() for layer in model if isinstance(layer, nn.Linear)]
    train(copy.deepcopy(model), [WorkerDevice("cpu", 0)], steps=4, per_step=1, plan=StagePlan.parse("|7"),
          casts="device")  # fmt: skip
    assert len(order) >= 2 * len(sizes) and order[: 2 * len(sizes)] == sizes * 2
    refresh, on_host = HostStore.refresh_group, []

    def recorded(self, index, step=0, copy=torch.Tensor.copy_):
        on_host.append(self.groups[index].data.numel())
        refresh(self, index, step, copy)

    monkeypatch.setattr(HostStore, "refresh_group", recorded)
    train(copy.deepcopy(model), [WorkerDevice("cpu", 0)], steps=4, per_step=1, plan=StagePlan.parse("|7"))
    assert on_host[: 2 * len(sizes)] == sizes[::-1] * 2


@pytest.mark.timeout(120)
def test_strategy_cast_updates_device_equals_host_under_bf16_mixed(monkeypatch):
    def run(cast: str):
        return fit(
            lambda: BoringPipeline(width=32),
            {"accelerator": "cpu", "devices": 2, "precision": "bf16-mixed",
             "strategy": RoundPipeStrategy(num_microbatches=2, cast_updates=cast)},
        )  # fmt: skip

    host = flat_weights(run("host"))
    monkeypatch.setattr(casts_module, "ThreadCaster", CountingCaster)
    CountingCaster.issued = 0
    assert torch.equal(flat_weights(run("device")), host)
    assert CountingCaster.issued > 0


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_the_gpu_casts_as_the_host_does_across_chunks(monkeypatch):
    monkeypatch.setattr(casts_module, "CHUNK", 1000)  # three chunks and a part: both staging slots reused
    src = torch.randn(3456) * torch.logspace(-30, 30, 3456)
    src[:4] = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0])
    dst = torch.empty(3456, dtype=torch.bfloat16).pin_memory()
    errors: list[BaseException] = []
    casts = casts_module.UpdateCasts([torch.device("cuda:0")], errors.append)
    landed = []
    casts.cast(0, dst, src.pin_memory(), lambda: landed.append(True))
    casts.before_write(0)
    assert casts.close() and landed == [True] and not errors
    assert torch.equal(dst, src.to(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_gpu_device_casts_give_the_host_casts_weights():
    model = mlp()
    kwargs = {"microbatches_per_round": 2, "seed": 7}
    host = train(copy.deepcopy(model), [CudaWorkerDevice("cuda:0", i) for i in range(2)], casts="host", **kwargs)
    device = train(copy.deepcopy(model), [CudaWorkerDevice("cuda:0", i) for i in range(2)], casts="device", **kwargs)
    assert torch.equal(device, host)


@pytest.mark.timeout(180)
def test_a_checkpoint_saved_during_validation_with_device_casts_resumes_as_the_hosts(tmp_path, monkeypatch):
    """The checkpoint keeps the compute copies the next step reads while late device casts are landing."""

    def run(directory, epochs, cast, ckpt=None):
        L.seed_everything(1, verbose=False)
        module = BoringPipeline(width=32)
        trainer = L.Trainer(
            strategy=RoundPipeStrategy(num_microbatches=3, plan="3,2|4,2,3", cast_updates=cast),
            accelerator="cpu", devices=2, max_epochs=epochs, precision="bf16-mixed", logger=False,
            enable_progress_bar=False, enable_model_summary=False, check_val_every_n_epoch=2,
            num_sanity_val_steps=0,
            callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=directory, filename="{epoch}", save_top_k=-1)],
        )  # fmt: skip
        trainer.fit(module, boring_data(), boring_data(24), ckpt_path=ckpt)
        return flat_weights(module)

    straight = run(tmp_path / "a", 4, "host")
    monkeypatch.setattr(casts_module, "ThreadCaster", CountingCaster)
    assert torch.equal(run(tmp_path / "b", 4, "device", ckpt=str(tmp_path / "a" / "epoch=1.ckpt")), straight)
    assert torch.equal(run(tmp_path / "c", 4, "device"), straight)
    resumed = run(tmp_path / "d", 4, "host", ckpt=str(tmp_path / "c" / "epoch=1.ckpt"))
    assert torch.equal(resumed, straight)
