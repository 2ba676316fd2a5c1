"""The shadow the optimizer thread steps: which optimizers may be stepped group by group, and the group values
the shadow and the real optimizer hand each other (runtime/shadow.py). The engine's results with such optimizers
are pinned in test_resident.py (host and device) against the staleness-one reference."""

from __future__ import annotations

import copy
import logging

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import BoringPipeline, fit, flat_weights
from test_async import GlobalNorm, GroupCounted, OwnSettings, batches, mlp
from torch import nn

from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.engine import PipelineEngine
from lightning_roundpipe.host_optimizer import check_coupling
from lightning_roundpipe.runtime import WorkerDevice
from lightning_roundpipe.runtime.shadow import GroupSync, _apart_for, shadow_optimizer, steps_apart
from lightning_roundpipe.runtime.updates import UpdateSpec


def _params() -> list[nn.Parameter]:
    return [nn.Parameter(torch.randn(3, 2)), nn.Parameter(torch.randn(4))]


TORCH_OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p),
    "adamw-fused": lambda p: torch.optim.AdamW(p, fused=True),
    "adam-amsgrad": lambda p: torch.optim.Adam(p, amsgrad=True),
    "sgd-nesterov": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    "adagrad": lambda p: torch.optim.Adagrad(p),
    "rmsprop": lambda p: torch.optim.RMSprop(p, momentum=0.5),
    "nadam": lambda p: torch.optim.NAdam(p),
    "radam": lambda p: torch.optim.RAdam(p),
    "adamax": lambda p: torch.optim.Adamax(p),
    "adadelta": lambda p: torch.optim.Adadelta(p),
    "adafactor": lambda p: torch.optim.Adafactor(p),
    "asgd": lambda p: torch.optim.ASGD(p),
    "rprop": lambda p: torch.optim.Rprop(p),
    "own-settings": lambda p: OwnSettings(p, lr=0.1),
}


@pytest.mark.parametrize("kind", sorted(TORCH_OPTIMIZERS))
def test_optimizers_that_treat_each_parameter_alone_are_stepped_group_by_group(kind):
    optimizer = TORCH_OPTIMIZERS[kind](_params())
    _apart_for.cache_clear()
    state = torch.get_rng_state()
    assert steps_apart(optimizer)
    assert torch.equal(torch.get_rng_state(), state)  # the probe draws from its own generator


class NoneGradFails(torch.optim.SGD):
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.grad.abs()  # no check for a parameter without a gradient
        return super().step(closure)


@pytest.mark.parametrize(
    "make",
    [
        lambda p: GroupCounted(p, lr=0.05),
        lambda p: GroupCounted(p, lr=0.0),  # a warm-up's zero LR: the probe moves them with its own
        lambda p: GlobalNorm(p, lr=0.05),
        lambda p: NoneGradFails(p, lr=0.1),  # cannot be stepped part by part at all
    ],
    ids=["group-count", "group-count-lr0", "global-norm", "needs-every-gradient"],
)
def test_optimizers_whose_step_couples_the_parameters_are_stepped_at_once(make):
    assert not steps_apart(make(_params()))


def test_the_shadow_keeps_what_its_steps_change_in_the_groups_and_takes_what_the_main_thread_changes():
    real = GroupCounted(_params(), lr=0.1)
    shadow, shadows_of = shadow_optimizer(real)
    sync = GroupSync(real, shadow)

    def update(**hyper):
        sync.apply([{**{k: v for k, v in real.param_groups[0].items() if k != "params"}, **hyper}])
        for p in real.param_groups[0]["params"]:
            shadows_of[id(p)].grad = torch.ones_like(p)
        shadow.step()

    update()
    update()
    assert shadow.param_groups[0]["step"] == 2 and "step" not in real.param_groups[0]
    sync.to_host()  # a flush: the steps' count reaches the real group
    assert real.param_groups[0]["step"] == 2
    real.param_groups[0]["lr"] = 0.05  # a scheduler
    update()
    assert shadow.param_groups[0]["lr"] == 0.05 and shadow.param_groups[0]["step"] == 3
    real.param_groups[0]["step"] = 10  # the user sets the count between steps: theirs wins over the steps'
    update()
    assert shadow.param_groups[0]["step"] == 11
    sync.to_host()
    assert real.param_groups[0]["step"] == 11
    real.load_state_dict({**real.state_dict(), "param_groups": [{**real.state_dict()["param_groups"][0], "step": 4}]})
    sync.from_host()  # a checkpoint loaded into the real optimizer
    assert shadow.param_groups[0]["step"] == 4


class Counted(BoringPipeline):
    def configure_optimizers(self):
        return GroupCounted(self.parameters(), lr=0.01)


def test_through_lightning_a_coupled_optimizer_is_said_once_and_several_nodes_refuse_it(caplog):
    with caplog.at_level(logging.INFO):
        module = fit(Counted, {"accelerator": "cpu", "devices": 1, "strategy": RoundPipeStrategy()})
    said = [r.getMessage() for r in caplog.records if "couples its parameters" in r.getMessage()]
    assert len(said) == 1 and "GroupCounted" in said[0]
    assert module.trainer.optimizers[0].param_groups[0]["step"] == module.trainer.global_step  # counted once a step
    with pytest.raises(ValueError, match=r"GroupCounted's step couples its parameters .* one node"):
        check_coupling([GroupCounted(_params(), lr=0.1)], num_nodes=2)
    assert check_coupling([torch.optim.AdamW(_params())], num_nodes=2) == []
    assert isinstance(module, L.LightningModule)


class TinySteps(torch.optim.SGD):  # outside torch.optim's module: probed
    pass


class StochasticRounding(torch.optim.SGD):
    """Each step draws from the global generator (as a bf16 stochastic-rounding step does)."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad + 1e-3 * torch.rand_like(p), alpha=-group["lr"])


class NeedsAGpu(torch.optim.SGD):
    def step(self, closure=None):
        raise RuntimeError("this kernel needs a CUDA device")


def test_the_probe_tells_coupled_from_unknown_and_keeps_the_users_random_stream(caplog):
    _apart_for.cache_clear()
    for settings in ({"capturable": True}, {"differentiable": True}):  # refused on CPU tensors, but torch.optim's
        assert steps_apart(torch.optim.AdamW(_params(), **settings)) is True
    assert steps_apart(TinySteps(_params(), lr=1e-12)) is True  # a tiny rate moves nothing an fp32 probe sees
    stochastic = StochasticRounding(_params(), lr=0.1)
    state = torch.get_rng_state()
    assert steps_apart(stochastic) is True  # the same draws in both orders
    assert torch.equal(torch.get_rng_state(), state)
    assert steps_apart(NeedsAGpu(_params(), lr=0.1)) is None
    with caplog.at_level(logging.INFO):
        assert check_coupling([NeedsAGpu(_params(), lr=0.1)], num_nodes=1) == ["NeedsAGpu"]
    assert any("could not be tried" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="could not be tried"):
        check_coupling([NeedsAGpu(_params(), lr=0.1)], num_nodes=2)


class Lookahead(torch.optim.Optimizer):
    """timm's Lookahead, abridged: it keeps the optimizer it wraps as an attribute and steps it."""

    def __init__(self, base: torch.optim.Optimizer, alpha: float = 0.5, k: int = 2) -> None:
        self._base_optimizer, self.param_groups, self.defaults = base, base.param_groups, base.defaults
        self.state: dict = {}
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}
        self.alpha, self.k, self.count = alpha, k, 0

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._base_optimizer.step(closure)
        self.count += 1
        if self.count % self.k == 0:
            for group in self.param_groups:
                for p in group["params"]:
                    slow = self.state.setdefault(p, {}).setdefault("slow", p.detach().clone())
                    slow.add_(p - slow, alpha=self.alpha)
                    p.copy_(slow)
        return loss


class LookaheadModule(BoringPipeline):
    def configure_optimizers(self):
        return Lookahead(torch.optim.SGD(self.parameters(), lr=0.1))


def test_an_optimizer_that_steps_another_trains_as_plain_lightning_on_the_main_thread():
    with pytest.raises(ValueError, match=r"steps another optimizer \(its '_base_optimizer'\)"):
        shadow_optimizer(Lookahead(torch.optim.SGD(_params(), lr=0.1)))  # the engine's thread refuses it
    plain = flat_weights(fit(LookaheadModule, {"accelerator": "cpu", "devices": 1}))
    with pytest.warns(UserWarning, match="steps another optimizer .* synchronous optimizer"):
        ours = fit(LookaheadModule, {"accelerator": "cpu", "devices": 1, "strategy": RoundPipeStrategy()})
    assert torch.allclose(flat_weights(ours), plain, rtol=1e-5, atol=1e-6)
    assert not torch.equal(flat_weights(ours), flat_weights(LookaheadModule()))  # it trained


@pytest.mark.parametrize("optimizer_on", ["host", "device"])
@pytest.mark.parametrize("flush_at", [None, 1])
def test_counts_kept_in_the_groups_survive_a_group_added_during_training(optimizer_on, flush_at):
    """A new shadow for the added group starts from the old shadow's counts, not from the real groups' (which
    hold the last flush's), and never writes the real groups from the optimizer thread."""
    model, data = mlp(), batches(7)
    params = list(model.parameters())
    optimizer = GroupCounted(params[:4], lr=0.05)
    engine = PipelineEngine(list(model), [WorkerDevice("cpu")], asynchronous=True, optimizer_on=optimizer_on)
    try:
        for t, [(x, y)] in enumerate(data):
            engine.train_batch(x, y, F.mse_loss)
            if t == 3:
                optimizer.add_param_group({"params": params[4:], "lr": 0.02})
            engine.submit_step(UpdateSpec.capture(optimizer))
            if t == flush_at:
                engine.flush()
        engine.flush()
    finally:
        engine.close()
    assert [group["step"] for group in optimizer.param_groups] == [7, 4]  # as stepping it by hand counts


def test_a_loaded_state_is_not_overwritten_by_the_shadow_it_replaces():
    model, data = mlp(), batches(7)
    optimizer = GroupCounted(model.parameters(), lr=0.05)
    engine = PipelineEngine(list(model), [WorkerDevice("cpu")], asynchronous=True, optimizer_on="host")
    try:
        for t, [(x, y)] in enumerate(data):
            engine.train_batch(x, y, F.mse_loss)
            engine.submit_step(UpdateSpec.capture(optimizer))
            if t == 2:
                engine.flush()
                saved = copy.deepcopy(optimizer.state_dict())  # a count of 3
            if t == 4:  # the update landed but nothing flushed: the old shadow still holds its own counts
                engine.crew.optimizer._last.math_done.wait()
                optimizer.load_state_dict(saved)  # back to 3; two more steps follow
        engine.flush()
    finally:
        engine.close()
    assert optimizer.param_groups[0]["step"] == 5


def test_bitsandbytes_overrides_reach_the_shadows_parameters():
    bnb = pytest.importorskip("bitsandbytes")
    embedding, linear = nn.Parameter(torch.randn(256, 64)), nn.Parameter(torch.randn(128, 64))
    bnb.optim.GlobalOptimManager.get_instance().override_config(embedding, "optim_bits", 32)
    optimizer = bnb.optim.AdamW8bit([embedding, linear], lr=1e-3)
    shadow, shadows_of = shadow_optimizer(optimizer)
    for p in (embedding, linear):
        shadows_of[id(p)].grad = torch.ones_like(p)
    shadow.step()
    dtypes = [optimizer.state[p]["state1"].dtype for p in (embedding, linear)]
    assert dtypes == [torch.float32, torch.uint8]  # the override's 32 bits, the others' 8
