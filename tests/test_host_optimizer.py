"""The host optimizer runs torch's fused CPU kernel unless the user chose otherwise, and a host step
longer than the devices' is reported once."""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import pytest
import torch
from helpers import BoringPipeline, boring_data, fit, flat_weights, relative_error

from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.host_optimizer import use_fused_kernels


class Spy(L.Callback):
    """Counts the fused AdamW kernel's calls and records the optimizer's group settings at the start."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        self.settings: list[tuple] = []
        kernel = torch._fused_adamw_

        def counted(*args, **kwargs):
            self.calls += 1
            return kernel(*args, **kwargs)

        monkeypatch.setattr(torch, "_fused_adamw_", counted)

    def on_train_start(self, trainer, pl_module):
        self.settings = [(g["fused"], g["foreach"]) for g in trainer.optimizers[0].param_groups]


@pytest.mark.parametrize("async_optimizer", [False, True])
def test_adamw_as_people_write_it_steps_with_the_fused_kernel(monkeypatch, async_optimizer):
    spy = Spy(monkeypatch)
    # (no spares: with them AdamW's asynchronous updates take the one pass, tests/test_one_pass.py)
    strategy = RoundPipeStrategy(num_microbatches=3, async_optimizer=async_optimizer, double_buffer=False)
    ours = fit(BoringPipeline, dict(strategy=strategy, accelerator="cpu", devices=2, callbacks=[spy], max_steps=4))
    assert spy.settings == [(True, None)]
    assert spy.calls >= 3  # every update ran the fused kernel (the shadow optimizer's too)
    monkeypatch.undo()
    plain = fit(BoringPipeline, dict(accelerator="cpu", devices=1, max_steps=4))
    if not async_optimizer:  # same algorithm: only the rounding differs from the unfused loop
        assert relative_error(flat_weights(ours), flat_weights(plain)) <= 1e-5


@pytest.mark.parametrize("choice", [dict(fused=False), dict(foreach=True), dict(foreach=False)])
def test_an_explicit_choice_is_kept_with_one_warning_giving_its_cost(choice):
    params = [torch.nn.Parameter(torch.randn(64)) for _ in range(2)]
    optimizer = torch.optim.AdamW(params, lr=1e-3, **choice)
    with pytest.warns(
        UserWarning, match=r"takes at least [0-9.e+]+ (s|ms|µs) per step .* fused CPU kernel about [0-9.e+]+ (s|ms|µs)"
    ) as seen:
        assert use_fused_kernels([optimizer]) == ["explicit"]
    assert len([w for w in seen if "fused CPU kernel" in str(w.message)]) == 1
    # a tiny model reads in its own units, not "0.00 s per step for these 0.000 B parameters"
    message = next(str(w.message) for w in seen if "fused CPU kernel" in str(w.message))
    assert "these 128 parameters" in message and "0.00 s" not in message
    group = optimizer.param_groups[0]
    assert group["fused"] is choice.get("fused") and group["foreach"] is choice.get("foreach")


def test_every_torch_optimizer_with_a_fused_cpu_kernel_gets_it_and_others_are_left_alone():
    def param() -> list[torch.nn.Parameter]:
        return [torch.nn.Parameter(torch.randn(8))]

    fusable = [torch.optim.Adam(param()), torch.optim.AdamW(param()), torch.optim.SGD(param(), lr=0.1),
               torch.optim.Adagrad(param())]  # fmt: skip
    others = [torch.optim.RMSprop(param()), torch.optim.Adam(param(), differentiable=True)]

    class OwnStep(torch.optim.AdamW):
        def step(self, closure=None):
            return super().step(closure)

    others.append(OwnStep(param()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert use_fused_kernels(fusable) == ["fused"] * 4
        assert use_fused_kernels(others) == ["not fusable", "kept", "not fusable"]
    for optimizer in fusable:
        assert optimizer.param_groups[0]["fused"] is True
        for p in optimizer.param_groups[0]["params"]:
            p.grad = torch.ones_like(p)
        optimizer.step()  # the fused kernel accepts what was switched after construction
    assert others[0].param_groups[0]["foreach"] is None and others[1].param_groups[0]["fused"] is None


def test_the_strategy_reports_its_host_step_time():
    strategy = RoundPipeStrategy(num_microbatches=3)
    fit(BoringPipeline, dict(strategy=strategy, accelerator="cpu", devices=2, max_steps=3), boring_data())
    assert strategy.host_step_s is not None and strategy.host_step_s > 0


def test_groups_of_equal_length_are_told_apart_and_a_calibration_that_fails_still_warns():
    """Per-layer groups (LoRA+'s A and B): dicts of tensors must not be compared by value. A subclass with
    its own constructor cannot be rebuilt on a scratch tensor: the warning comes without numbers."""
    weights = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(3)]
    optimizer = torch.optim.AdamW([{"params": [w]} for w in weights[:2]] + [{"params": [weights[2]], "foreach": False}])
    with pytest.warns(UserWarning, match="fused CPU kernel"):
        assert use_fused_kernels([optimizer]) == ["fused"]
    assert [g["fused"] for g in optimizer.param_groups] == [True, True, None]

    class Mine(torch.optim.AdamW):
        def __init__(self, params, lr):
            super().__init__(params, lr=lr, foreach=False)

    with pytest.warns(UserWarning, match=r"foreach=False\), not torch's fused CPU kernel"):
        assert use_fused_kernels([Mine(weights, 1e-3)]) == ["explicit"]


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_a_step_the_loss_scaler_skips_leaves_the_fused_optimizer_as_the_unfused_one(kind):
    """fp16 loss scaling skips steps with non-finite gradients. The fused optimizer must not be stepped on
    them (fused SGD would allocate its momentum buffers without filling them): the same weights as the
    unfused optimizer through a skipped step, a good one, and an unfused group beside a fused one."""

    def run(fused: bool) -> torch.Tensor:
        torch.manual_seed(0)
        a, b = torch.nn.Parameter(torch.randn(16)), torch.nn.Parameter(torch.randn(16))
        groups = [{"params": [a]}, {"params": [b], "foreach": False}]
        make = {
            "sgd": lambda: torch.optim.SGD(groups, lr=0.1, momentum=0.9),
            "adamw": lambda: torch.optim.AdamW(groups),
        }
        optimizer = make[kind]()
        if fused:
            use_fused_kernels([optimizer], calibrate=False)
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        scaler.scale(torch.ones(()))  # creates the scale tensor, as RoundPipePrecision does
        for grad in (float("inf"), 1.0, 0.5):
            for p in (a, b):
                p.grad = torch.full_like(p, grad * scaler.get_scale())
            scaler.unscale_(optimizer)  # what RoundPipePrecision does before the step
            scaler.step(optimizer)
            scaler.update()
        return torch.cat([a.detach(), b.detach()])

    got, want = run(True), run(False)
    assert torch.isfinite(got).all() and relative_error(got, want) <= 1e-6


class Optimized(BoringPipeline):
    """The boring pipeline with the optimizer a test names, written as users write it (fused/foreach unset)."""

    def __init__(self, make: Any) -> None:
        super().__init__()
        self.make = make

    def configure_optimizers(self) -> Any:
        return self.make(self.parameters())


OPTIMIZERS = {
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.1),
}


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_bf16_true_with_the_optimizer_left_unset_trains_like_plain_lightning(kind):
    """torch 2.13's fused CPU SGD leaves bf16 parameters unchanged: switched on by default, the weight
    matrices would never move (only the biases, through another path). The kernel is probed and kept
    only where it agrees; every weight moves as plain Lightning's bf16-true moves it, within rounding."""
    make = OPTIMIZERS[kind]
    start = fit(lambda: Optimized(make), dict(accelerator="cpu", devices=1, precision="bf16-true", max_steps=0))
    plain = fit(lambda: Optimized(make), dict(accelerator="cpu", devices=1, precision="bf16-true"))
    strategy = RoundPipeStrategy(num_microbatches=2, async_optimizer=False)
    ours = fit(lambda: Optimized(make), dict(accelerator="cpu", devices=2, precision="bf16-true", strategy=strategy))
    before = flat_weights(start).double()
    theirs, mine = flat_weights(plain).double() - before, flat_weights(ours).double() - before
    matrices = torch.cat([p.detach().flatten() for n, p in start.named_parameters() if n.endswith("weight")])
    assert theirs.norm() > 0.05 * matrices.double().norm()
    assert relative_error(mine, theirs) <= 0.1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_fused_kernel_that_disagrees_with_the_unfused_step_is_not_used(dtype):
    unset = torch.optim.SGD([torch.nn.Parameter(torch.randn(8).to(dtype))], lr=0.1, momentum=0.9)
    chosen = torch.optim.SGD([torch.nn.Parameter(torch.randn(8).to(dtype))], lr=0.1, fused=True)
    with pytest.warns(UserWarning, match=rf"unfused loop for {dtype} parameters \(100% apart\).*fused SGD leaves"):
        assert use_fused_kernels([unset, chosen], calibrate=False) == ["unfused", "unfused"]
    assert unset.param_groups[0]["fused"] is None and chosen.param_groups[0]["fused"] is False
    fp32 = torch.optim.SGD([torch.nn.Parameter(torch.randn(8))], lr=0.1, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert use_fused_kernels([fp32]) == ["fused"]  # and AdamW on bf16, within rounding: fused
        assert use_fused_kernels([torch.optim.AdamW([torch.nn.Parameter(torch.randn(8).to(dtype))])]) == ["fused"]


def test_frozen_parameters_do_not_decide_the_kernel():
    """``AdamW(self.parameters())`` over a LoRA model: fp32 adapters beside a frozen bf16 base and frozen 4-bit
    packed bytes (bitsandbytes' uint8). Only the adapters are ever stepped: they take the fused kernel, with no
    warning (the frozen bf16 and uint8 tensors once made the whole group unfused: 0.36 s host steps for an 8B
    QLoRA's 42 M adapter parameters against 0.11 s with a bf16 base on an H200)."""
    adapters = torch.nn.Parameter(torch.randn(8))
    base = torch.nn.Parameter(torch.randn(8).to(torch.bfloat16), requires_grad=False)
    packed = torch.nn.Parameter(torch.zeros(4, dtype=torch.uint8), requires_grad=False)
    for cls in (torch.optim.AdamW, torch.optim.SGD):
        optimizer = cls([adapters, base, packed], lr=0.1)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert use_fused_kernels([optimizer], calibrate=False) == ["fused"]
        assert optimizer.param_groups[0]["fused"] is True
        adapters.grad = torch.ones(8)
        before = (base.detach().clone(), adapters.detach().clone())
        optimizer.step()  # the fused kernel skips the frozen ones (no gradient)
        assert base.equal(before[0]) and not adapters.equal(before[1])
        adapters.grad = None


def test_an_optimizer_the_host_cannot_step_is_refused_at_setup():
    """LBFGS re-evaluates the loss through a closure inside its step; an optimizer whose kernel needs a GPU
    fails on the host's CPU tensors: both are refused before the first batch, saying why."""

    class CudaOnly(torch.optim.SGD):
        def step(self, closure=None):
            raise RuntimeError("this kernel runs on CUDA tensors only")

    cases = {
        "LBFGS.step needs a closure": lambda params: torch.optim.LBFGS(params),
        "CudaOnly's step failed on a CPU probe": lambda params: CudaOnly(params, lr=0.1),
    }
    for message, make in cases.items():
        for async_optimizer in (False, True):
            strategy = RoundPipeStrategy(num_microbatches=2, async_optimizer=async_optimizer)
            with pytest.raises(ValueError, match=message):
                fit(lambda make=make: Optimized(make), dict(strategy=strategy, accelerator="cpu", devices=2))


def test_the_host_step_checks_touch_no_random_numbers_and_keep_an_explicit_unfused_choice():
    """Setup must not move the user's random stream (data order, dropout), and a group that asked for no fused
    kernel is neither probed nor warned about as if the kernel had been refused."""
    from lightning_roundpipe.host_optimizer import check_host_step

    params = [torch.nn.Parameter(torch.randn(8, 4).to(torch.bfloat16))]
    optimizers = [torch.optim.SGD(params, lr=0.1, momentum=0.9), torch.optim.AdamW(params, fused=False)]
    state = torch.get_rng_state()
    with pytest.warns(UserWarning) as seen:
        assert use_fused_kernels(optimizers, calibrate=False) == ["unfused", "explicit"]
        check_host_step(optimizers)
    assert torch.equal(torch.get_rng_state(), state)
    assert len(seen) == 1 and "SGD" in str(seen[0].message)


def test_an_optimizer_whose_step_needs_its_own_mode_is_warned_about_not_refused():
    """Schedule-free optimizers keep a mode in their groups that the user switches before training: a probe
    that fails for another reason than a device says so once and lets the run start."""
    from lightning_roundpipe.host_optimizer import check_host_step

    class Moded(torch.optim.SGD):
        def __init__(self, params, lr=0.1):
            super().__init__(params, lr=lr)
            for group in self.param_groups:
                group["train_mode"] = False

        def train(self):
            for group in self.param_groups:
                group["train_mode"] = True

        def step(self, closure=None):
            if not all(group["train_mode"] for group in self.param_groups):
                raise RuntimeError("not in train mode: call optimizer.train() first")
            return super().step(closure)

    optimizer = Moded([torch.nn.Parameter(torch.randn(4))])
    with pytest.warns(UserWarning, match=r"Moded's step failed on a CPU probe .*not in train mode"):
        check_host_step([optimizer])
    optimizer.train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_host_step([optimizer])  # the group's mode is the probe's too


@pytest.mark.timeout(180)
def test_bitsandbytes_8bit_adamw_trains_as_with_plain_lightning():
    """``bnb.optim.AdamW8bit(self.parameters())``, as QLoRA recipes write it, on bitsandbytes' CPU kernels: the
    synchronous step equals plain Lightning's, and the asynchronous one (which steps a shadow of it; it failed at
    the first update before the shadow carried the optimizer's own attributes) runs the same on the host and with
    the states on the device."""
    bnb = pytest.importorskip("bitsandbytes")

    def make(params: Any) -> Any:
        return bnb.optim.AdamW8bit(params, lr=1e-2, min_8bit_size=16)  # 8-bit states for these small tensors too

    start = flat_weights(fit(lambda: Optimized(make), dict(accelerator="cpu", devices=1, max_steps=0)))
    plain = fit(lambda: Optimized(make), dict(accelerator="cpu", devices=1))
    sync = RoundPipeStrategy(num_microbatches=2, async_optimizer=False)
    ours = fit(lambda: Optimized(make), dict(accelerator="cpu", devices=2, strategy=sync))
    # (8-bit moments round to one of 256 levels a block: gradients summed in another order may take a neighbour)
    assert relative_error(flat_weights(ours) - start, flat_weights(plain) - start) <= 1e-3
    runs = {}
    for place in ("host", "device"):
        strategy = RoundPipeStrategy(num_microbatches=2, optimizer_on=place)
        module = fit(lambda: Optimized(make), dict(accelerator="cpu", devices=1, strategy=strategy))
        runs[place] = flat_weights(module)
        assert "state1" in str(module.trainer.optimizers[0].state_dict())  # the 8-bit states reached the host
    assert torch.equal(runs["host"], runs["device"])
    moved, theirs = runs["host"] - start, flat_weights(plain) - start  # one step stale: the same way, not equal
    assert torch.nn.functional.cosine_similarity(moved, theirs, dim=0) >= 0.95
