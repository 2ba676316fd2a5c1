"""Precision: compute copies on the host, bf16/fp16 on the workers, fp16 dynamic loss scaling."""

from __future__ import annotations

from functools import partial

import lightning as L
import pytest
import torch
from helpers import BoringPipeline, fit, flat_weights, relative_error
from torch import nn

from lightning_roundpipe import RoundPipePrecision, RoundPipeStrategy
from lightning_roundpipe.runtime import HostStore

CPU = {"accelerator": "cpu"}


def test_compute_copies_follow_the_masters():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    model[1].register_buffer("scale", torch.full((4,), 3.0))
    store = HostStore(list(model.children()), compute_dtype=torch.bfloat16)
    kinds = {(g.layer, g.kind): g for g in store.groups}
    assert kinds[(0, "trainable")].compute.dtype == torch.bfloat16
    assert kinds[(1, "buffer")].compute is kinds[(1, "buffer")].data  # buffers keep their dtype
    assert torch.equal(kinds[(0, "trainable")].compute, kinds[(0, "trainable")].data.bfloat16())

    opt = torch.optim.AdamW(model.parameters(), lr=0.5, fused=True)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # fused kernels do not bump version counters: the strategy marks the store dirty
    store.mark_dirty()
    assert store.sync_compute() == 2
    assert torch.equal(kinds[(0, "trainable")].compute, kinds[(0, "trainable")].data.bfloat16())
    with torch.no_grad():
        model[0].weight.mul_(2)  # an in-place edit is seen through the version counter
    assert store.sync_compute() == 1
    assert torch.equal(kinds[(0, "trainable")].compute, kinds[(0, "trainable")].data.bfloat16())
    assert store.sync_compute() == 0


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_trains_close_to_fp32(precision):
    plain = fit(BoringPipeline, {**CPU, "devices": 1})
    strategy = RoundPipeStrategy(precision_plugin=RoundPipePrecision(precision), async_optimizer=False)
    ours = fit(BoringPipeline, {**CPU, "devices": 2, "strategy": strategy})
    assert all(p.dtype == torch.float32 for p in ours.parameters())
    assert relative_error(flat_weights(ours), flat_weights(plain)) <= 3e-2


_SPIKE = {"at_call": -1, "calls": 0}


class _InfGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


class Spike(nn.Module):
    """Identity whose gradient is infinite on one chosen training batch."""

    def forward(self, x):
        if torch.is_grad_enabled() and _SPIKE["calls"] == _SPIKE["at_call"]:
            return _InfGradient.apply(x)
        return x


class Recorder(L.Callback):
    def __init__(self) -> None:
        self.scales: list[float] = []
        self.weights: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        _SPIKE["calls"] += 1
        self.scales.append(trainer.strategy.precision_plugin.loss_scale)
        self.weights.append(flat_weights(pl_module).clone())


def test_fp16_non_finite_gradients_skip_the_step_and_lower_the_scale():
    class WithSpike(BoringPipeline):
        def __init__(self):
            super().__init__()
            self.model.insert(4, Spike())

    recorder = Recorder()
    _SPIKE.update(at_call=2, calls=0)
    try:
        strategy = RoundPipeStrategy(precision_plugin=RoundPipePrecision("16-mixed"), async_optimizer=False)
        fit(WithSpike, {**CPU, "devices": 2, "strategy": strategy, "callbacks": [recorder]})
    finally:
        _SPIKE.update(at_call=-1, calls=0)
    scales, weights = recorder.scales, recorder.weights
    assert scales[0] == scales[1] == 65536.0
    assert scales[2] == 32768.0  # lowered once
    assert torch.equal(weights[2], weights[1])  # the step with infinite gradients was skipped
    assert not torch.equal(weights[3], weights[2])  # training goes on
    assert all(torch.isfinite(w).all() for w in weights)


def test_sixteen_mixed_with_the_asynchronous_optimizer_is_refused():
    strategy = RoundPipeStrategy(precision_plugin=RoundPipePrecision("16-mixed"))
    with pytest.raises(ValueError, match=r"16-mixed' with the asynchronous optimizer.*async_optimizer=False"):
        fit(BoringPipeline, {**CPU, "devices": 2, "strategy": strategy})


def test_sixteen_mixed_from_the_trainer_flag_on_cpu_becomes_bf16():
    # Lightning itself turns precision="16-mixed" into bf16 on CPU; the strategy follows.
    module = fit(partial(BoringPipeline), {**CPU, "devices": 2, "strategy": "roundpipe", "precision": "16-mixed"})
    assert module.trainer.strategy.precision_plugin.precision == "bf16-mixed"
