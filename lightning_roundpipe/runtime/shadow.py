"""The user's optimizer as the optimizer thread steps it: a *shadow* of it over parameter objects of its own.

The shadow has the optimizer's class and every instance attribute (bitsandbytes' optimizers keep their settings
there), the per-parameter state, and parameters that share storage with the masters, so the main thread's
``zero_grad`` and LR schedulers never race the update. The engine steps it group by group, as each flat group's
gradient is complete. Two things an optimizer may keep beyond per-parameter state make that differ from one step
of all parameters, silently (``benchmarks/optimizer_zoo.py``, four steps on the CPU against the staleness-one
reference, relative to the weights, 2026-12-07: schedule-free AdamW 2.5e-2, pytorch_optimizer's Lamb 1.0e-1, Adan
4.4e-2, AdEMAMix 3.9e-2, Prodigy 3.5e-5; torch.optim's, bitsandbytes' AdamW8bit and Lion within 4e-8):

- values in its parameter groups that its steps change (a step count, schedule-free's ``k`` and ``weight_sum``,
  Prodigy's ``d``): :class:`GroupSync` gives the shadow, at each update, only what the main thread changed since the
  last capture (a scheduler's LR), and at a flush writes what the steps changed back into the real groups, so
  checkpoints hold it;
- steps that couple parameters (a norm over all of them, a count per ``step()`` call): :func:`steps_apart` probes,
  on a small copy, whether stepping the parameters part by part equals one step of all; where it does not, the
  update waits for the step's last gradient and steps once.
"""

from __future__ import annotations

import collections
import functools
import inspect
from typing import Any

import torch
from torch import Tensor, nn

PROBE_LR = 0.01
"""The coupling probe's least learning rate: zero (a warm-up's start) or a tiny one moves nothing it can compare."""
APART_TOLERANCE = 1e-4
"""Relative difference of the probe's updates, stepped apart and together, within which they are the same step."""


class _SharedState(dict):
    """The shadow's per-parameter state: the real optimizer's own dicts, looked up on first use only (so
    parameters the shadow never steps, such as frozen ones, get no state entry at all)."""

    def __init__(self, real_state: dict[Any, Any], real_of: dict[int, nn.Parameter]) -> None:
        super().__init__()
        self._real_state = real_state
        self._real_of = real_of

    def __missing__(self, shadow_param: Any) -> dict[str, Any]:
        state = self._real_state[self._real_of[id(shadow_param)]]
        self[shadow_param] = state
        return state


def shadow_optimizer(optimizer: torch.optim.Optimizer) -> tuple[torch.optim.Optimizer, dict[int, nn.Parameter]]:
    """A copy of ``optimizer`` over new parameter objects that share storage and per-parameter state.

    Returns the shadow and a map from ``id(real parameter)`` to its shadow parameter.
    """
    shadows_of: dict[int, nn.Parameter] = {}
    real_of: dict[int, nn.Parameter] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in shadows_of:
                sp = nn.Parameter(p.detach(), requires_grad=p.requires_grad)
                shadows_of[id(p)] = sp
                real_of[id(sp)] = p
    return optimizer_over(optimizer, shadows_of, _SharedState(optimizer.state, real_of)), shadows_of


def wrapped_optimizer(optimizer: torch.optim.Optimizer) -> str | None:
    """The attribute through which ``optimizer`` steps another optimizer (timm's ``Lookahead`` keeps its base one
    so), else ``None``. A shadow cannot be built over it: copying the attribute would step the user's inner
    optimizer over the user's parameters, which the asynchronous optimizer leaves without gradients."""
    for name, value in vars(optimizer).items():
        inner = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, torch.optim.Optimizer) and v is not optimizer for v in inner):
            return name
    return None


def optimizer_over(optimizer: torch.optim.Optimizer, shadows_of: dict[int, nn.Parameter], state: Any) -> Any:
    """``optimizer``'s class, attributes and group values over the parameters ``shadows_of`` maps the real ones to
    (by ``id``; those it does not map are left out), with ``state`` as its per-parameter state."""
    if (name := wrapped_optimizer(optimizer)) is not None:
        raise ValueError(
            f"{type(optimizer).__name__} steps another optimizer (its {name!r}), which a shadow over copies of the"
            " parameters cannot step: use the synchronous optimizer (async_optimizer=False)"
        )
    # Every attribute, not only the three torch pickles (what ``copy.copy`` keeps): bitsandbytes' optimizers and
    # others read their own settings from the instance in ``step``.
    shadow = object.__new__(type(optimizer))
    shadow.__dict__.update(optimizer.__dict__)
    # An LR scheduler wraps ``optimizer.step`` in an instance attribute bound to the real optimizer:
    # the shadow must call its class's own step.
    shadow.__dict__.pop("step", None)
    for hooks in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):  # the user's hooks are the real
        if hooks in shadow.__dict__:  # step's, not each group's
            setattr(shadow, hooks, collections.OrderedDict())
    shadow.param_groups = [
        {**_values(group), "params": [shadows_of[id(p)] for p in group["params"] if id(p) in shadows_of]}
        for group in optimizer.param_groups
    ]
    shadow.state = state
    _carry_overrides(optimizer, shadows_of)
    return shadow


def _carry_overrides(optimizer: torch.optim.Optimizer, shadows_of: dict[int, nn.Parameter]) -> None:
    """bitsandbytes' per-parameter settings (``GlobalOptimManager``'s overrides: an embedding kept in 32 bits),
    which its optimizers look up by the parameter's ``id`` and position, for the shadow's parameters too."""
    manager = getattr(optimizer, "mng", None)
    configs = getattr(manager, "pid2config", None)
    if not isinstance(configs, dict):
        return
    modules = getattr(manager, "module_weight_config_triple", ())
    by_module = {id(getattr(m, name)): config for m, name, config in modules if getattr(m, name, None) is not None}
    by_index = getattr(manager, "index2config", {})
    for i, group in enumerate(optimizer.param_groups):
        for j, p in enumerate(group["params"]):
            config = {**by_index.get((i, j), {}), **by_module.get(id(p), {}), **configs.get(id(p), {})}
            if config and id(p) in shadows_of:
                configs[id(shadows_of[id(p)])] = config


class GroupSync:
    """The shadow's group values against the real optimizer's. What the main thread changes (a scheduler's LR)
    reaches the shadow at the next update; what the shadow's steps change (a step count kept in the group) stays
    the shadow's, and reaches the real groups at a flush."""

    def __init__(self, real: torch.optim.Optimizer, shadow: torch.optim.Optimizer) -> None:
        self.real, self.shadow = real, shadow
        self.captured = [_values(group) for group in real.param_groups]
        """Per group, the values the last update took from the main thread (or the last flush wrote there)."""

    def apply(self, hyperparameters: list[dict[str, Any]]) -> None:
        """Before an update (the optimizer thread): the captured values that changed since the last capture."""
        for group, hyper, seen in zip(self.shadow.param_groups, hyperparameters, self.captured):
            for key, value in hyper.items():
                if key not in seen or not _same(value, seen[key]):
                    group[key], seen[key] = value, _copied(value)

    def to_host(self) -> None:
        """At a flush, with no update running: the values the steps changed, into the real groups, except where
        the main thread changed that value too since (its change goes to the shadow at the next update)."""
        for real, group, seen in zip(self.real.param_groups, self.shadow.param_groups, self.captured):
            for key, value in group.items():
                if key == "params" or (key in seen and _same(value, seen[key])):
                    continue  # not the steps' change
                if key in real and key in seen and not _same(real[key], seen[key]):
                    continue  # the main thread's change, newer
                real[key], seen[key] = _copied(value), _copied(value)

    def carry(self, old: GroupSync) -> None:
        """A new shadow of the same optimizer and state (groups were added): the old shadow's values and captures
        for the groups it had, so what its steps changed since the last flush is neither lost nor taken for the
        main thread's change (and nothing is written to the real groups from the optimizer thread)."""
        for group, old_group in zip(self.shadow.param_groups, old.shadow.param_groups):
            group.update(_values(old_group))
        self.captured[: len(old.captured)] = old.captured

    def from_host(self) -> None:
        """After the real optimizer was loaded (a checkpoint): every group value from the real groups."""
        for group, real in zip(self.shadow.param_groups, self.real.param_groups):
            group.update(_values(real))
        self.captured = [_values(group) for group in self.real.param_groups]


def steps_apart(optimizer: torch.optim.Optimizer) -> bool | None:
    """Whether stepping ``optimizer``'s parameters part by part (the others' gradients ``None``) moves them as
    one step of all does, for each of its groups' values: probed on two small fp32 parameters shaped like the
    group's over three steps (a few milliseconds; the last 64 answers kept). torch.optim's own classes treat each
    parameter alone and are not probed. ``None`` where the probe cannot run (a kernel that needs a GPU, a setting
    the CPU refuses): the engine then steps all parameters at once, as the user's code would."""
    if type(optimizer).__module__.startswith("torch.optim."):
        return True
    for group in optimizer.param_groups:
        trainable = [p for p in group["params"] if p.requires_grad][:2]
        if not trainable:
            continue
        shapes = tuple(tuple(min(n, 6) for n in p.shape) for p in trainable * (3 - len(trainable)))[:2]
        key = _key(group)
        try:
            apart = _apart_for(type(optimizer), key, shapes)
        except TypeError:  # a value that cannot be hashed: probed each time
            apart = _apart_for.__wrapped__(type(optimizer), key, shapes)
        if not apart:
            return apart
    return True


@functools.lru_cache(maxsize=64)
def _apart_for(cls: type, key: tuple[tuple[str, Any], ...], shapes: tuple[tuple[int, ...], ...]) -> bool | None:
    """The probe of :func:`steps_apart` for one group's values, on parameters shaped like its first two (at most
    6 along each dimension: a matrix-only optimizer gets matrices). Its own random generator, seeded alike for both
    orders: the user's stream is not drawn from, and a stochastic step (rounding) draws the same numbers."""
    values = dict(key)
    settings = constructor_settings(cls, values)
    if isinstance(settings.get("lr"), (int, float)) and settings["lr"] < PROBE_LR:
        settings["lr"] = PROBE_LR  # a tiny rate moves nothing an fp32 probe can see
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(shape, generator=g) for shape in shapes]
    grads = [[torch.randn(t.shape, generator=g) for t in start] for _ in range(3)]
    moved = []
    try:
        with torch.random.fork_rng(devices=[]):
            for apart in (False, True):
                torch.manual_seed(0)
                params = [nn.Parameter(t.clone()) for t in start]
                scratch = cls(params, **settings)
                scratch.param_groups[0].update({k: v for k, v in values.items() if k not in settings and k != "lr"})
                scratch._need_device_dtype_check_for_fused = bool(values.get("fused"))
                for step in grads:
                    for part in ([0], [1]) if apart else ([0, 1],):
                        for i, p in enumerate(params):
                            p.grad = step[i].clone() if i in part else None
                        scratch.step()
                moved.append(torch.cat([(p.detach() - t).flatten().double() for p, t in zip(params, start)]))
    except Exception:  # it cannot be rebuilt or stepped so: unknown
        return None
    together, parts = moved
    return float((together - parts).norm()) <= APART_TOLERANCE * float(together.norm())


def constructor_settings(cls: type, group: dict[str, Any]) -> dict[str, Any]:
    """The group's values ``cls``'s constructor takes, without the parameters and the kernel choice."""
    accepted = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in group.items() if k in accepted and k not in ("params", "fused", "foreach")}


def _key(group: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """A group's values but its parameters, as a hashable key (tensors and lists as tuples or numbers)."""
    return tuple(sorted((k, _plain(v)) for k, v in group.items() if k != "params"))


def _plain(value: Any) -> Any:
    if isinstance(value, Tensor):
        return tuple(value.tolist()) if value.dim() else value.item()
    return tuple(value) if isinstance(value, list) else value


def _values(group: dict[str, Any]) -> dict[str, Any]:
    """A group's values but its parameters, copied (the steps may change a tensor or a list in place)."""
    return {k: _copied(v) for k, v in group.items() if k != "params"}


def _copied(value: Any) -> Any:
    return (
        value.clone() if isinstance(value, Tensor) else type(value)(value) if isinstance(value, (list, dict)) else value
    )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape and bool(torch.equal(a, b))
    try:
        return bool(a == b)
    except Exception:  # values whose comparison is not a truth value: taken as changed
        return False
