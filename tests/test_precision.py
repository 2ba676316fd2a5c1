"""Precision: compute copies on the host, bf16/fp16 on the workers, fp16 dynamic loss scaling."""

from __future__ import annotations

import copy
from functools import partial

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import BoringPipeline, boring_data, fit, flat_weights, relative_error
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


class _NanForward(nn.Module):
    """Identity whose output is NaN on one chosen training batch (the loss is NaN then)."""

    def forward(self, x):
        if torch.is_grad_enabled() and _SPIKE["calls"] == _SPIKE["at_call"]:
            return x * float("nan")
        return x


@pytest.mark.parametrize("async_optimizer", [False, True])
def test_fp16_a_nan_loss_is_a_skipped_step_not_an_error(async_optimizer):
    """Under 16-mixed a non-finite loss is what loss scaling handles: the step is skipped, training goes on
    (it once failed the check that the returned loss is the pipeline's: NaN is not equal to NaN)."""

    class WithNan(BoringPipeline):
        def __init__(self):
            super().__init__()
            self.model.insert(4, _NanForward())

    recorder = Recorder()
    _SPIKE.update(at_call=2, calls=0)
    try:
        strategy = RoundPipeStrategy(precision_plugin=RoundPipePrecision("16-mixed"), async_optimizer=async_optimizer,
                                     plan="|10")  # fmt: skip
        fit(WithNan, {**CPU, "devices": 1, "strategy": strategy, "callbacks": [recorder]})
    finally:
        _SPIKE.update(at_call=-1, calls=0)
    assert len(recorder.weights) == 8 and all(torch.isfinite(w).all() for w in recorder.weights)
    assert min(recorder.scales) == 32768.0  # lowered once


class WithSpike(BoringPipeline):
    def __init__(self):
        super().__init__()
        self.model.insert(4, Spike())


def test_fp16_non_finite_gradients_skip_the_step_and_lower_the_scale():
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


def fp16_staleness_one_reference(model, data, scaler_kwargs, spike_at):
    """Plain fp16 autocast training with the asynchronous optimizer's semantics written out: step t's
    gradients are computed on the weights before update t-1, with the loss scale after update t-2's
    decision; the update unscales, skips on non-finite gradients and decides as ``GradScaler`` does."""
    from test_async import make_optimizer

    current, lagged = copy.deepcopy(model), copy.deepcopy(model)
    opt = make_optimizer(current.parameters())
    scaler = torch.amp.GradScaler("cpu", **scaler_kwargs)
    scaler.scale(torch.ones(()))
    initial, scales = scaler.get_scale(), {}
    for t, (x, y) in enumerate(data):
        _SPIKE.update(at_call=spike_at, calls=t)
        used = initial if t < 2 else scales[t - 2]
        lagged.zero_grad()
        with torch.autocast("cpu", torch.float16):
            loss = F.mse_loss(lagged(x), y)
        (loss * used).backward()
        for p, q in zip(current.parameters(), lagged.parameters()):
            p.grad = q.grad.clone()
        found = torch.zeros(1)
        grads = [p.grad for p in current.parameters()]
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, torch.full((1,), 1.0 / used))
        before = copy.deepcopy(current.state_dict())
        if not found.item():
            opt.step()
        torch._amp_update_scale_(scaler._scale, scaler._growth_tracker, found, 2.0, 0.5, scaler._growth_interval)
        scales[t] = scaler.get_scale()
        lagged.load_state_dict(before)
    _SPIKE.update(at_call=-1, calls=0)
    return torch.cat([p.detach().flatten() for p in current.parameters()]), scales


def test_sixteen_mixed_asynchronous_equals_the_staleness_one_reference_with_a_grad_scaler():
    """The optimizer thread unscales, skips the step whose gradients are not finite (an injected inf at
    step 3), halves the scale and grows it after two finite steps; every batch of step t used the
    scale after update t-2's decision."""
    from test_async import make_optimizer, mlp

    from lightning_roundpipe.engine import PipelineEngine
    from lightning_roundpipe.runtime import WorkerDevice
    from lightning_roundpipe.runtime.updates import UpdateSpec

    base = nn.Sequential(*list(mlp().children())[:2], Spike(), *list(mlp().children())[2:])
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(8)]
    scaler_kwargs = {"init_scale": 2.0**10, "growth_interval": 2}
    want, want_scales = fp16_staleness_one_reference(base, data, scaler_kwargs, spike_at=3)
    model = copy.deepcopy(base)
    precision = RoundPipePrecision("16-mixed", torch.amp.GradScaler("cpu", **scaler_kwargs))
    layers = list(model.children())
    engine = PipelineEngine(  # one fused stage: a batch's backward is over before its loss comes back,
        layers, [WorkerDevice("cpu", 0)], plan=f"|{len(layers)}", microbatches_per_round=1, asynchronous=True,
        compute_dtype=torch.float16, autocast_dtype=torch.float16,  # so the spike hits the batch it is set for
    )  # fmt: skip
    opt = make_optimizer(model.parameters())
    used = []
    try:
        for t, (x, y) in enumerate(data):
            _SPIKE.update(at_call=3, calls=t)
            used.append(precision.step_scale(engine))
            engine.train_batch(x, y, F.mse_loss, grad_scale=used[-1], last_of_step=True)
            engine.submit_step(
                UpdateSpec.capture(opt, scaler=precision.scaler, loss_scale=precision.step_scale(engine))
            )
        engine.flush()
    finally:
        _SPIKE.update(at_call=-1, calls=0)
        engine.close()
    got = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert used == [1024.0] * 2 + [want_scales[t - 2] for t in range(2, 8)]
    assert want_scales[3] == want_scales[2] / 2 and want_scales[5] == want_scales[4] * 2  # skipped, then grown
    assert engine.crew.optimizer.scales == {t: want_scales[t] for t in range(8)}
    assert relative_error(got, want) <= 1e-6


def test_sixteen_mixed_through_lightning_with_the_asynchronous_optimizer_skips_a_non_finite_step():
    recorder = Recorder()
    _SPIKE.update(at_call=2, calls=0)
    try:
        strategy = RoundPipeStrategy(precision_plugin=RoundPipePrecision("16-mixed"))
        fit(WithSpike, {**CPU, "devices": 2, "strategy": strategy, "callbacks": [recorder]})
    finally:
        _SPIKE.update(at_call=-1, calls=0)
    scales = recorder.scales
    assert scales[:4] == [65536.0] * 4 and scales[4] == 32768.0  # step 2's decision reaches step 4
    assert all(torch.isfinite(w).all() for w in recorder.weights)


def test_sixteen_mixed_from_the_trainer_flag_on_cpu_becomes_bf16():
    # Lightning itself turns precision="16-mixed" into bf16 on CPU; the strategy follows.
    module = fit(partial(BoringPipeline), {**CPU, "devices": 2, "strategy": "roundpipe", "precision": "16-mixed"})
    assert module.trainer.strategy.precision_plugin.precision == "bf16-mixed"


# ---------------------------------------------------------------------------------------------- bf16-true
BF16_TRUE = {**CPU, "precision": "bf16-true"}


def test_bf16_true_with_one_micro_batch_equals_plain_lightning_bf16_true():
    """The masters are the bf16 weights: the same arithmetic as plain Lightning's bf16-true, bit for bit
    on one CPU worker; parameters and optimizer states are bf16 and no fp32 or compute copy is kept."""
    plain = fit(partial(BoringPipeline, fused=True), {**BF16_TRUE, "devices": 1})
    strategy = RoundPipeStrategy(num_microbatches=1, async_optimizer=False)
    ours = fit(partial(BoringPipeline, fused=True), {**BF16_TRUE, "devices": 1, "strategy": strategy})
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    states = ours.trainer.optimizers[0].state.values()
    assert all(t.dtype == torch.bfloat16 for state in states for k, t in state.items() if k != "step")
    assert relative_error(flat_weights(ours), flat_weights(plain)) <= 1e-4


def test_bf16_true_over_micro_batches_and_workers_stays_within_their_summing():
    """Several micro-batches on two workers: each micro-batch's bf16 gradients are summed (on the device
    within a round, on the host across rounds and batches, in fp32 arithmetic rounded to bf16), so the
    weights stay within that rounding of plain bf16-true, and of fp32 training."""
    accumulate = {"accumulate_grad_batches": 2}
    plain = fit(partial(BoringPipeline, fused=True), {**BF16_TRUE, **accumulate, "devices": 1})
    strategy = RoundPipeStrategy(num_microbatches=3, num_rounds=2, async_optimizer=False)
    ours = fit(partial(BoringPipeline, fused=True), {**BF16_TRUE, **accumulate, "devices": 2, "strategy": strategy})
    fp32 = fit(partial(BoringPipeline, fused=True), {**CPU, **accumulate, "devices": 1})
    assert relative_error(flat_weights(ours), flat_weights(plain)) <= 2e-2
    assert relative_error(flat_weights(ours), flat_weights(fp32)) <= 3e-2


def test_bf16_true_keeps_about_8_host_bytes_per_parameter():
    """What the engine holds, and what the preflight estimate says: bf16 masters (the compute weights in
    the synchronous mode), bf16 gradients, AdamW's two bf16 moments; a bf16 compute copy more when the
    optimizer is asynchronous (it updates the masters while the workers read the previous weights)."""
    from lightning_roundpipe import estimate_host_memory

    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)).to(torch.bfloat16)
    sync = estimate_host_memory(model, torch.bfloat16, asynchronous=False)
    assert sync.total / sync.trainable_parameters == 8
    assert estimate_host_memory(model, torch.bfloat16, asynchronous=True).total / sync.trainable_parameters == 10
    store = HostStore(list(model.children()), compute_dtype=torch.bfloat16)
    assert store.nbytes() == 4 * store.num_parameters  # masters (= compute weights) and gradients
    assert all(g.compute is g.data and g.grad.dtype == torch.bfloat16 for g in store.groups)


def test_bf16_true_asynchronous_equals_the_staleness_one_reference_in_bf16():
    from test_async import batches, make_optimizer, mlp, staleness_one_reference

    from lightning_roundpipe.engine import PipelineEngine
    from lightning_roundpipe.runtime import WorkerDevice
    from lightning_roundpipe.runtime.updates import UpdateSpec

    model = mlp().to(torch.bfloat16)
    data = [[(x.bfloat16(), y.bfloat16()) for x, y in step] for step in batches(5)]
    want = staleness_one_reference(copy.deepcopy(model), data)
    engine = PipelineEngine(
        list(model.children()), [WorkerDevice("cpu", 0)], microbatches_per_round=1, asynchronous=True,
        compute_dtype=torch.bfloat16,
    )  # fmt: skip
    assert all(g.data.dtype == torch.bfloat16 for g in engine.store.groups)
    opt = make_optimizer(model.parameters())
    try:
        for step in data:
            for x, y in step:
                engine.train_batch(x, y, F.mse_loss, last_of_step=True)
            engine.submit_step(UpdateSpec.capture(opt))
        engine.flush()
    finally:
        engine.close()
    got = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert got.dtype == torch.bfloat16 and relative_error(got, want) <= 1e-4


def _fit_and_save(directory, epochs, ckpt=None, **trainer_kwargs):
    L.seed_everything(1, verbose=False)
    module = BoringPipeline(fused=True)
    trainer = L.Trainer(
        strategy=RoundPipeStrategy(num_microbatches=3), accelerator="cpu", devices=2, max_epochs=epochs,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=directory, filename="{epoch}", save_top_k=-1)],
        **trainer_kwargs,
    )  # fmt: skip
    trainer.fit(module, boring_data(), ckpt_path=ckpt)
    return module


def test_sixteen_mixed_asynchronous_checkpoint_resumes_exactly(tmp_path):
    """The scales the next two steps use travel in the engine's state; the scaler's own in Lightning's."""
    kwargs = {"plugins": [RoundPipePrecision("16-mixed", torch.amp.GradScaler("cpu", growth_interval=2))]}
    straight = _fit_and_save(tmp_path / "a", 2, **kwargs)
    kwargs = {"plugins": [RoundPipePrecision("16-mixed", torch.amp.GradScaler("cpu", growth_interval=2))]}
    saved = torch.load(tmp_path / "a" / "epoch=0.ckpt", weights_only=False)["roundpipe"]
    assert sorted(saved["loss_scales"]) == [6, 7]  # 8 steps per epoch: what steps 8 and 9 use
    resumed = _fit_and_save(tmp_path / "b", 2, ckpt=str(tmp_path / "a" / "epoch=0.ckpt"), **kwargs)
    assert torch.equal(flat_weights(resumed), flat_weights(straight))


def test_bf16_true_checkpoint_resumes_exactly(tmp_path):
    def run(directory, epochs, ckpt=None):
        return _fit_and_save(directory, epochs, ckpt, precision="bf16-true")

    straight = run(tmp_path / "a", 2)
    saved = torch.load(tmp_path / "a" / "epoch=0.ckpt", weights_only=False)
    assert all(t.dtype == torch.bfloat16 for t in saved["state_dict"].values())
    moments = [t for s in saved["optimizer_states"][0]["state"].values() for k, t in s.items() if k != "step"]
    assert moments and all(t.dtype == torch.bfloat16 for t in moments)
    resumed = run(tmp_path / "b", 2, ckpt=str(tmp_path / "a" / "epoch=0.ckpt"))
    assert torch.equal(flat_weights(resumed), flat_weights(straight))
