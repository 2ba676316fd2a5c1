"""Regional compilation (``RoundPipeStrategy(compile=...)``): each pipelined layer's body compiled with
``torch.compile``, the code shared by every block and every worker.

Many small micro-batches are bound by the host: eager PyTorch issues each block's kernels one Python
call at a time (docs/tuning.md). A compiled block issues fewer, fused kernels from generated code.

What is compiled is a layer's ``compile_targets()`` where it has them (a Hugging Face decoder stage
names its block, a split stage its attention or MLP; the embedding and the head name none), otherwise
the layer itself. Each target gets an instance ``forward``: the class's ``forward`` compiled once per
class and bound to the module, so the workers' replicas (deep copies) keep it, bound to themselves, and
all blocks of a class share one compiled code and its guards (weights are inputs to it, not constants:
a slot's tensors change every stage). Only replicas run it compiled; the host's own modules keep
running the class's code. The classes stay as they are, and :func:`remove` takes the
instance attributes off again. A module that already carries an instance ``forward`` (patched by its
user) is left as it is.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import threading
import types
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch._functorch import config as functorch_config

_MARK = "__roundpipe_compiled__"


CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
"""torch.compile modes that record CUDA graphs: a graph replays fixed addresses, and a slot's weights move
at every stage (each stage would record again)."""


def compile_options(choice: bool | str | dict[str, Any]) -> dict[str, Any] | None:
    """The ``torch.compile`` keyword arguments of ``RoundPipeStrategy(compile=choice)`` (``None``: off;
    ``"auto"`` gives the defaults and ``fullgraph``, whether it applies is :func:`auto_applies`'s to say), with
    this strategy's defaults where the user gave none: ``dynamic=True`` (batch and sequence sizes vary: one
    compile instead of a static one and then a dynamic one, and fewer of the 8 variants a code keeps) and,
    for Inductor without a ``mode`` or ``options``, ``fallback_random`` (a forward stage and the recompute of
    a backward stage run different graphs: torch's own random ops draw the same dropout masks in both under
    the layer's seed). A clear error for anything ``torch.compile`` would not take, and for CUDA graphs."""
    if choice is False:
        return None
    if choice == "auto":  # a graph break fails the compile (which falls back) instead of splitting the block
        choice = {"fullgraph": True}
    if choice is True:
        choice = {}
    if not isinstance(choice, dict):
        raise ValueError(
            f"RoundPipeStrategy(compile={choice!r}) must be 'auto', True, False or a dict of torch.compile's"
            ' keyword arguments, e.g. {"mode": "max-autotune-no-cudagraphs"}'
        )
    allowed = set(inspect.signature(torch.compile).parameters) - {"model"}
    unknown = sorted(set(choice) - allowed)
    if unknown:
        raise ValueError(
            f"RoundPipeStrategy(compile=...) got {unknown}, which torch.compile does not take; it takes"
            f" {sorted(allowed)}"
        )
    if choice.get("mode") in CUDA_GRAPH_MODES or (choice.get("options") or {}).get("triton.cudagraphs"):
        raise ValueError(
            f"RoundPipeStrategy(compile={choice!r}) records CUDA graphs, which replay fixed addresses; a stage's"
            ' weights move at every stage. Use mode="max-autotune-no-cudagraphs" or "default".'
        )
    options = {"dynamic": True, **choice}
    if options.get("backend", "inductor") == "inductor" and "mode" not in options and "options" not in options:
        options["options"] = {"fallback_random": True}
    return options


def auto_applies(cuda: bool, preset: bool) -> bool:
    """Whether ``compile="auto"`` compiles: the decoder blocks of a Hugging Face preset on CUDA workers, where
    Inductor has Triton. Measured on an H200 (docs/benchmarks.md, 2026-12-02, eighth session): 51.0k tokens/s
    against 49.3k with Liger's kernels in eager blocks at 2 micro-batches, 44.1k against 24.1k at 16. CPU
    workers and an ``nn.Sequential``'s layers (the user's own code) run as written unless asked."""
    if not (cuda and preset):
        return False
    try:
        from torch.utils._triton import has_triton
    except ImportError:  # a torch without this helper: Inductor's CUDA code needs Triton all the same
        return importlib.util.find_spec("triton") is not None
    return has_triton()


def foreign_kernels(layers: Iterable[nn.Module]) -> list[str]:
    """Modules of ``layers`` running liger-kernel's code, put there by the user (its classes, an instance
    ``forward`` from it, or its rotary embedding in the module's globals): ``compile="auto"`` leaves such a
    model eager, as its user chose it. Our own binding of Liger's kernels comes after compilation."""
    found = set()
    for layer in layers:
        for m in layer.modules():
            try:  # Liger patches the rotary function among the attention's globals
                rotary = getattr(inspect.unwrap(type(m).forward), "__globals__", {}).get("apply_rotary_pos_emb")
            except Exception:  # e.g. a TorchScript module's forward
                rotary = None
            codes = (type(m), m.__dict__.get("forward"), rotary)
            if any((getattr(code, "__module__", None) or "").startswith("liger_kernel") for code in codes):
                found.add(type(m).__name__)
    return sorted(found)


def _compile_errors() -> tuple[type[BaseException], ...]:
    from torch._dynamo import exc

    return (exc.BackendCompilerFailed, exc.InternalTorchDynamoError, exc.Unsupported)


COMPILE_ERRORS = _compile_errors()
"""What torch.compile raises when it cannot compile (a backend's or dynamo's own failure), as opposed to
an error of the model's code, which an eager run would raise too."""


def targets(layer: nn.Module) -> list[nn.Module]:
    """The modules of ``layer`` whose ``forward`` is compiled."""
    named = getattr(layer, "compile_targets", None)
    return list(named()) if callable(named) else [layer]


def apply(layers: Iterable[nn.Module], options: dict[str, Any], fallback: bool = False) -> list[str]:
    """Bind each target's class ``forward``, compiled with ``options``, onto it; returns what was
    compiled, as ``"Qwen3DecoderLayer x28"``-style counts. ``fallback`` (``compile="auto"``): a class whose
    forward fails to compile (or, at a variant's first compile, the backward graph made with it) runs
    eagerly from then on, with one warning, instead of failing the batch. A backward graph that fails in
    a later recompile still fails its batch at the backward, with the executor's ``compile=False`` note."""
    compiled: dict[type, Any] = {}
    counts: dict[str, int] = {}
    for layer in layers:
        for module in targets(layer):
            if "forward" in module.__dict__ and not getattr(module.__dict__["forward"], _MARK, False):
                continue  # the user's own; ours, left by a setup that failed, is bound again
            cls = type(module)
            if cls not in compiled:
                compiled[cls] = _on_workers(cls, options, fallback)
            module.forward = types.MethodType(compiled[cls], module)
            counts[cls.__name__] = counts.get(cls.__name__, 0) + 1
    return [f"{name} x{n}" for name, n in sorted(counts.items())]


def _on_workers(cls: type, options: dict[str, Any], fallback: bool = False) -> Any:
    """``cls.forward`` compiled where the module is a worker's replica (its ``_roundpipe_replica`` names the
    worker's device, set by the runtime), the class's own code elsewhere: the host's model, run by the user
    outside the pipeline (or for logits in validation), is not compiled for the host's CPU on the way.

    One compiled code per :func:`_variant`: torch.compile keeps at most 8 variants per code object (then
    runs eagerly, with only a log line), and one run makes more than that of a block: with and without
    grad (forward stage, recompute), training and evaluation, with and without a mask, per device (a
    tensor's device is in the guards). Calls on one device already take turns (a replica runs under its
    device's generator lock, :meth:`~lightning_roundpipe.runtime.WorkerDevice.seeded`), which matters:
    torch.compile does not look in its cache again after waiting for another thread's compile."""
    codes: dict[tuple, Any] = {}
    eager_on: set[str] = set()  # devices where this class failed to compile (``fallback``)
    ran: set[tuple] = set()  # variants whose code returned once (compiled, its backward graph with it)
    made = threading.Lock()

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        device = self.__dict__.get("_roundpipe_replica")
        if not device or device in eager_on:
            return cls.forward(self, *args, **kwargs)
        key = _variant(device, self, args, kwargs)
        code = codes.get(key)
        if code is None:
            with made:
                code = codes.setdefault(key, torch.compile(_own_code(cls, len(codes)), **options))
        try:
            if fallback and key not in ran:  # until a call returned: one that failed may not have compiled
                with _FIRST_CALLS, _backward_with_forward():
                    out = code(self, *args, **kwargs)
                ran.add(key)
                return out
            return code(self, *args, **kwargs)
        except COMPILE_ERRORS as e:  # raised while compiling: under ``fullgraph`` nothing has run yet
            if not fallback:
                raise
            eager_on.add(device)
            why = " ".join(line.strip() for line in str(e).strip().splitlines()[:2])[:300]
            warnings.warn(
                f"roundpipe: torch.compile could not compile {cls.__name__} on {device} ({why}); it runs"
                " eagerly. RoundPipeStrategy(compile=False) silences this; compile=True makes it an error.",
                stacklevel=2,
            )
            return cls.forward(self, *args, **kwargs)

    setattr(forward, _MARK, True)
    return forward


_FIRST_CALLS = threading.RLock()
"""Held by a variant's calls under ``fallback`` until one returned: they compile its backward graph with its
forward (AOTAutograd otherwise compiles it at the first backward: a failure there fails the batch, past where
the fallback can run the class eagerly). torch before 2.12 keeps config patches process-wide, so first calls on
several devices take turns: each restores the value it found (dynamo compiles one at a time anyway)."""


def _backward_with_forward() -> contextlib.AbstractContextManager:
    """AOTAutograd compiling a backward graph with its forward, where torch has the switch (for this thread
    from torch 2.12, for the process before: hence :data:`_FIRST_CALLS`)."""
    if not hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        return contextlib.nullcontext()
    return functorch_config.patch(force_non_lazy_backward_lowering=True)


def _variant(device: str, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """What separates a call's compiled code from another's: the device, grad mode, training mode and which
    arguments are ``None`` (a block's mask is absent when no sequence is padded)."""
    given = tuple(a is None for a in args), tuple(sorted((k, v is None) for k, v in kwargs.items()))
    return device, torch.is_grad_enabled(), module.training, given


def _own_code(cls: type, number: int) -> Any:
    """``cls.forward`` called from a function whose code object is its own. torch.compile keeps its
    compiled variants per code object, and wraps torch's own modules' ``forward`` in one shared function:
    without this, every class and variant would share one cache and its limit of variants."""

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return cls.forward(self, *args, **kwargs)

    name = f"{cls.__name__}_forward_{number}"
    forward.__code__ = forward.__code__.replace(co_name=name)
    forward.__name__ = forward.__qualname__ = name
    return forward


def remove(layers: Iterable[nn.Module]) -> None:
    """Take the compiled ``forward`` off again (the class's own shows through)."""
    for layer in layers:
        for module in targets(layer):
            if getattr(module.__dict__.get("forward"), _MARK, False):
                del module.forward
