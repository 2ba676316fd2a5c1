"""Shells: a model's own ``forward`` run over stand-ins, so a stage executes the code around the blocks
exactly as the model wrote it.

A shell is a module of the model's class with the model's attributes (its config, its flags) but
children of its own: the children a stage needs (the rotary module, the final norm, the head), a
:class:`StandIn` in each block's place, an :class:`Absent` for what lives in another stage, and for the
causal LM's base model a :class:`Given`. Calling the shell runs the class's ``forward``; what the
stand-ins do is the running :class:`Driver`'s to say: pass the hidden states through and record what the
model hands each block, return the stage's own hidden states in the last block's place, or stop the
forward once it has produced what the stage needed (:class:`Stop`).

The driver and the given value are per thread (each worker runs one shell at a time) and set by
:func:`run` for the duration of one call, so a recompute on autograd's thread finds its own.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

_CURRENT = threading.local()

_HOOKS = (
    "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks",
)  # fmt: skip


class Stop(BaseException):  # not an Exception: it ends a forward early, past any `except Exception`
    """Ends a shell's ``forward`` early, carrying what the stage wanted from it."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value


@dataclass
class Call:
    """What the model handed one block: its hidden states, the other positional and keyword arguments."""

    hidden: Tensor
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    positional: bool
    """The hidden states came as the first positional argument (else as ``hidden_states=``)."""


Driver = Callable[["StandIn", Call], Any]
"""What a stand-in does when the model calls it: returns the block's output as the model expects it, or
raises :class:`Stop`."""


class StandIn(nn.Module):
    """Block ``index``'s place in a shell. It carries the block's plain attributes (a forward may read
    ``layer.attention_type``) and returns what the running driver says, as a tensor or, where the model
    indexes its blocks' outputs, a one-tuple (``as_tuple``)."""

    def __init__(self, index: int, block: nn.Module, as_tuple: bool = False) -> None:
        super().__init__()
        for name, value in block.__dict__.items():
            if not name.startswith("_") and name != "training" and type(value) in (bool, int, float, str):
                self.__dict__[name] = value
        self.index = index
        self.as_tuple = as_tuple

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        kwargs = dict(kwargs)
        if args:
            call = Call(args[0], args[1:], kwargs, positional=True)
        else:
            call = Call(kwargs.pop("hidden_states"), (), kwargs, positional=False)
        return _CURRENT.driver(self, call)

    def output(self, hidden: Tensor) -> Any:
        """``hidden`` as the model expects a block to return it."""
        return (hidden,) if self.as_tuple else hidden


class Absent(nn.Module):
    """A child of the model that this stage does not run (its weights live in another stage)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"roundpipe's generic stage did not expect the model to call `{self.name}` here (its build-time probe"
            " saw the model's forward call it elsewhere)"
        )


class Given(nn.Module):
    """The base model's place in the causal LM's shell: returns the base model's output computed before."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _CURRENT.given


class Captured(nn.Module):
    """Runs ``module`` (the base model's shell) and stops the forward around it with its output: what the
    causal LM's code after it is then given, tile by tile (:class:`Given`)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise Stop(self.module(*args, **kwargs))


class HeadInput(nn.Module):
    """The LM head's place when the loss is computed in chunks: stops the forward with the head's input."""

    def forward(self, hidden: Tensor) -> Any:
        raise Stop(hidden)


class _Original:
    """A shell's model module, shared by every copy of the shell (the workers' replicas are deep copies)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __deepcopy__(self, memo: dict[int, Any]) -> _Original:
        return self


_ORIGINAL = "_roundpipe_original"


class Watched:
    """What a stage's recorded block arguments are made of, shared by every copy of the stage: ``modules``
    (the rotary module: their tensors) and ``owners`` (the base model and the causal LM: their own tensors and
    training mode). :meth:`version` changes when one of these tensors is replaced or changed in place (a rope
    schedule between batches) or the mode changes, read from the host's modules."""

    def __init__(self, modules: list[nn.Module], owners: list[nn.Module]) -> None:
        self.modules, self.owners = modules, owners

    def __deepcopy__(self, memo: dict[int, Any]) -> Watched:
        return self

    def tensors(self) -> list[Tensor]:
        held = [t for m in self.modules for t in (*m.parameters(), *m.buffers())]
        return held + [t for m in self.owners for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))]

    def version(self) -> tuple[Any, ...]:
        return (*(n for t in self.tensors() for n in (id(t), t._version)), *(m.training for m in self.owners))


def follow(module: nn.Module) -> None:
    """A shell (and the shell it wraps) in its model's training mode: ``model.train()`` and ``model.eval()``
    reach the model's modules, not the shells, and a model's ``forward`` may read ``self.training``."""
    for m in (module, *module._modules.values()):
        m = m.module if isinstance(m, Captured) else m
        original = m.__dict__.get(_ORIGINAL)
        if original is not None:
            m.training = original.module.training


def shell(
    module: nn.Module, children: dict[str, nn.Module], keep: set[str] | frozenset[str] = frozenset()
) -> nn.Module:
    """A module of ``module``'s class and attributes whose children are ``children`` where named there,
    ``module``'s own where named in ``keep`` and :class:`Absent` elsewhere; no hooks, and the class's
    ``forward`` (an instance ``forward``, the interceptor's or a compiled body, is not the model's code)."""
    clone = copy.copy(module)
    for name in ("forward", "_old_forward"):  # an instance forward (the interceptor's, a compiled body, a hook's)
        clone.__dict__.pop(name, None)
    clone.__dict__[_ORIGINAL] = _Original(module)
    clone._modules = {
        name: children[name] if name in children else child if name in keep else Absent(name)
        for name, child in module._modules.items()
    }
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    for hooks in _HOOKS:
        if hasattr(clone, hooks):
            setattr(clone, hooks, OrderedDict())
    return clone


def run(module: nn.Module, driver: Driver | None, given: Any = None, **inputs: Any) -> tuple[Any, Any]:
    """Call ``module(**inputs)`` with ``driver`` deciding for its stand-ins and ``given`` for a
    :class:`Given`: ``(output, None)``, or ``(None, value)`` when the forward was stopped with ``value``."""
    previous = getattr(_CURRENT, "driver", None), getattr(_CURRENT, "given", None)
    _CURRENT.driver, _CURRENT.given = driver, given
    follow(module)
    try:
        return module(**inputs), None
    except Stop as stop:
        return None, stop.value
    finally:
        _CURRENT.driver, _CURRENT.given = previous


def first_input(stand_in: StandIn, call: Call) -> Any:
    """Stop at the first block with its hidden states: what the embedding part of the model made."""
    raise Stop(call.hidden)


def recorder(last: int, calls: dict[int, Call]) -> Driver:
    """Record each block's call into ``calls`` and pass the hidden states through; stop after ``last``."""

    def record(stand_in: StandIn, call: Call) -> Any:
        calls[stand_in.index] = call
        if stand_in.index >= last:
            raise Stop(calls)
        return stand_in.output(call.hidden)

    return record


def replacing_last(last: int, hidden: Tensor) -> Driver:
    """Pass the hidden states through, and return ``hidden`` in block ``last``'s place: the model's code
    after its blocks then runs on the stage's own hidden states."""

    def replace(stand_in: StandIn, call: Call) -> Any:
        return stand_in.output(hidden if stand_in.index == last else call.hidden)

    return replace
