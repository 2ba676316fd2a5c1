"""The shadow the optimizer thread steps: which optimizers may be stepped group by group, and the group values
the shadow and the real optimizer hand each other (runtime/shadow.py). The engine's results with such optimizers
are pinned in test_resident.py (host and device) against the staleness-one reference."""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch
from helpers import BoringPipeline, fit
from test_async import GlobalNorm, GroupCounted, OwnSettings
from torch import nn

from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.host_optimizer import check_coupling
from lightning_roundpipe.runtime.shadow import GroupSync, _apart_for, shadow_optimizer, steps_apart


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
