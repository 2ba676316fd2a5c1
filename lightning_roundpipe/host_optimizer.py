"""The host optimizer at full speed: torch's fused CPU kernels by default.

Master weights live on the host, so the optimizer steps there. With ``fused`` and ``foreach`` left unset
torch's Adam, AdamW, SGD and Adagrad take their one-tensor-at-a-time loop on the CPU: on the GPU
machine's 16 cores, 1.7 B parameters of ``AdamW`` took longer than the devices' whole step, so the GPUs
waited even with the asynchronous optimizer. Their fused CPU kernels run the same algorithm (only the
rounding may differ), several times faster. :func:`use_fused_kernels` switches every parameter group
that left both unset to the fused kernel; an explicit choice is kept, with one warning that gives its
measured cost. A fused kernel is used only where it agrees with the unfused step for the parameters'
dtype on a small probe (torch 2.13's fused CPU SGD leaves bf16 and fp16 parameters unchanged).
:func:`check_host_step` refuses, at setup, an optimizer the host step cannot run. Its step against the devices'
is watched by :mod:`~lightning_roundpipe.host_clock`.
"""

from __future__ import annotations

import functools
import inspect
import re
import time
import warnings
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_roundpipe.runtime.callers import outside_package
from lightning_roundpipe.runtime.shadow import constructor_settings, steps_apart

CALIBRATION_ELEMENTS = 1 << 22
"""Parameters of the scratch tensor an explicit choice's cost is measured on (16 MiB in fp32)."""


def fusable(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is one of torch's with a fused CPU kernel (a subclass that keeps its step)."""
    if "fused" not in optimizer.defaults:
        return False
    base = next((c for c in type(optimizer).__mro__ if c.__module__.startswith("torch.optim")), None)
    return base is not None and type(optimizer).step is base.step


def _stepped(group: dict[str, Any]) -> list[torch.Tensor]:
    """The group's parameters a step can change: those that require grad. The host store fixes which are
    trainable at setup (a frozen one has no gradient buffer), so frozen ones (a LoRA base, bf16 or 4-bit packed)
    never reach the kernel and do not decide it."""
    return [p for p in group["params"] if p.requires_grad]


def _group_fusable(group: dict[str, Any]) -> bool:
    if group.get("differentiable") or group.get("capturable"):
        return False
    return all(p.device.type == "cpu" and torch.is_floating_point(p) for p in _stepped(group))


def use_fused_kernels(optimizers: list[Any], calibrate: bool = True) -> list[str]:
    """Give every parameter group that left ``fused`` and ``foreach`` unset the fused kernel, where it agrees
    with the unfused step (:func:`fused_disagrees`); warn once per optimizer that chose otherwise, with the
    measured cost. Returns what was done, per optimizer (``"unfused"``: the kernel disagreed)."""
    done = []
    for optimizer in optimizers:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # Lightning's LightningOptimizer
        if not fusable(optimizer):
            done.append("not fusable")
            continue
        unset = [g for g in optimizer.param_groups if g.get("fused") is None and g.get("foreach") is None]
        unset_ids = {id(g) for g in unset}  # by identity: groups compare by their tensors otherwise
        chosen = [g for g in optimizer.param_groups if id(g) not in unset_ids and not g.get("fused")]
        refused = _refuse_disagreeing_kernel(optimizer)
        switched = [g for g in unset if _group_fusable(g) and id(g) not in refused]
        for group in switched:
            group["fused"] = True
        if switched:
            # What the constructor would check. Not ``_step_supports_amp_scaling``: with it GradScaler calls
            # ``step()`` on a step it skips (for fused SGD that allocates momentum buffers it never fills), and
            # RoundPipePrecision unscales before stepping anyway, so GradScaler's own skip is the right one.
            optimizer._need_device_dtype_check_for_fused = True
        if chosen and calibrate:
            _warn_explicit_choice(optimizer, chosen)
        done.append("fused" if switched else "unfused" if refused else "explicit" if chosen else "kept")
    return done


def needs_a_gpu(optimizer: Any) -> bool:
    """Whether ``optimizer``'s step fails on a CPU probe as a GPU-only kernel does (its states fit only a GPU)."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # Lightning's LightningOptimizer
    return any(_DEVICE_ERROR.search(str(_probe_step(optimizer, g) or "")) for g in optimizer.param_groups)


def check_host_step(optimizers: list[Any], on_device: bool = False) -> None:
    """Refuse, at setup, an optimizer the host step cannot run: one whose ``step`` needs a closure (it would
    run the pipeline again inside the step), or, unless its states are on the GPU (``on_device``), one whose step
    fails on a CPU probe shaped like its parameters (a CUDA-only kernel). Without this the first failure would come
    from the optimizer thread, a step late, or as a divergence."""
    for optimizer in optimizers:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # Lightning's LightningOptimizer
        name = type(optimizer).__name__
        closure = inspect.signature(type(optimizer).step).parameters.get("closure")
        if closure is not None and closure.default is inspect.Parameter.empty:
            raise ValueError(
                f"{name}.step needs a closure that evaluates the loss again, several times per step. Under"
                " roundpipe a batch's forward and backward run once, in the pipeline, and the step is applied to"
                " host master weights afterwards (on a host thread, one step later, by default); nothing can"
                " re-evaluate the loss inside the step. Use a first-order optimizer (torch.optim.AdamW, Adam,"
                " SGD, Adagrad, RMSprop, ...), or another strategy for this one."
            )
        for group in optimizer.param_groups if not on_device else ():
            error = _probe_step(optimizer, group)
            if error is None:
                continue
            what = f"{name}'s step failed on a CPU probe shaped like its parameters ({type(error).__name__}: {error})"
            if _DEVICE_ERROR.search(str(error)):
                raise ValueError(
                    f"roundpipe steps the optimizer on the host (CPU), where the master weights live, but {what}. An"
                    " optimizer whose kernels need a GPU cannot run there: use torch.optim.AdamW (its fused CPU"
                    " kernel is the default) or another CPU-capable optimizer, or, on one GPU with room for its"
                    " states, RoundPipeStrategy(optimizer_on='device')."
                ) from error
            warnings.warn(  # not a device's: it may depend on what the user does before the first step
                f"roundpipe steps the optimizer on the host (CPU), where the master weights live; {what}. If its"
                " first real step fails the same way, that is why.",
                stacklevel=outside_package(),
            )
            break


def check_coupling(optimizers: list[Any], num_nodes: int, split: bool = False) -> list[str]:
    """The optimizers stepped at once (their step couples their parameters, or the probe could not tell:
    :func:`~lightning_roundpipe.runtime.shadow.steps_apart`), each said once: the asynchronous updates wait for a
    step's last gradient and step them at once. Several nodes, which each update their own groups, refuse them,
    as does a share of the states on the GPU (``split``: the device steps its groups apart from the host's)."""
    coupled = []
    for optimizer in optimizers:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # Lightning's LightningOptimizer
        apart = steps_apart(optimizer)
        if apart:
            continue
        name = type(optimizer).__name__
        why = "couples its parameters (one step of all differs from steps of parts)" if apart is False else None
        why = why or "could not be tried on small CPU parameters, so whether it treats each parameter alone is unknown"
        if num_nodes > 1 or split:
            parts = "roundpipe's nodes each update" if num_nodes > 1 else "the GPU and the host (a share) update"
            raise ValueError(
                f"{name}'s step {why}, and {parts} their own part of the model: use an optimizer whose step treats"
                " each parameter alone (torch.optim's), or one node and optimizer_on='host' or 'device'."
            )
        rank_zero_info(
            f"roundpipe: {name}'s step {why}, so each update waits for the step's last gradient and steps them at"
            " once (torch.optim's optimizers are stepped group by group as each gradient completes)"
        )
        coupled.append(name)
    return coupled


_DEVICE_ERROR = re.compile(r"cuda|gpu|device|triton", re.IGNORECASE)
"""What a step that cannot run on the host's CPU tensors says (a CUDA-only kernel)."""


def _probe_step(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> Exception | None:
    """The exception of one step of ``optimizer``'s class with ``group``'s settings (and the state it keeps
    in the group, such as a schedule-free optimizer's mode) on a small CPU parameter of its first parameter's
    dtype and rank, or ``None`` (it ran, or the class cannot be rebuilt). Draws from its own generator: the
    user's random numbers are not touched."""
    first = next((p for p in group["params"] if p.requires_grad), None)
    if first is None:
        return None
    settings = _settings(optimizer, group)
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn([min(n, 4) for n in first.shape], generator=g).to(first.dtype))
    try:
        scratch = type(optimizer)([p], **settings)
    except Exception:  # its own constructor (the user built it, so it works on the real parameters' terms)
        return None
    scratch.param_groups[0].update({k: v for k, v in group.items() if k != "params"})  # its kernel choice too
    scratch._need_device_dtype_check_for_fused = bool(group.get("fused"))
    try:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        scratch.step()
    except Exception as error:
        return error
    return None


PROBE_ELEMENTS = 256
"""Parameters of the probe a fused kernel is checked on (:func:`fused_disagrees`)."""
PROBE_LR = 0.1
"""The probe's learning rate: updates well above the rounding of 16-bit parameters, whatever the user's."""
DISAGREEMENT = 0.1
"""Relative difference of the fused kernel's update from the unfused one's beyond which it is not used: bf16
rounding of an update of ``PROBE_LR`` differs by about 1-2%; a kernel that skips the parameters, by 100%."""


def _refuse_disagreeing_kernel(optimizer: torch.optim.Optimizer) -> set[int]:
    """The groups (by id) whose parameters' dtype makes the fused kernel disagree with the unfused step:
    those that asked for it explicitly go back to the unfused step, and one warning names the kernel."""
    refused, seen = set(), []
    for group in optimizer.param_groups:
        if (
            group.get("fused") is False
            or group.get("foreach")
            or group.get("differentiable")
            or group.get("capturable")
        ):
            continue  # the user's choice of no fused kernel: nothing to check
        settings = _settings(optimizer, group)
        for dtype in sorted({p.dtype for p in _stepped(group) if torch.is_floating_point(p)}, key=str):
            difference = fused_disagrees(type(optimizer), _key(settings), dtype)
            if difference is None:
                continue
            refused.add(id(group))
            if group.get("fused"):
                group["fused"] = False
                if optimizer.defaults.get("fused"):  # a group added later (a layer unfrozen) would take it again
                    optimizer.defaults["fused"] = False
            seen.append(f"{dtype} parameters ({difference:.0%} apart)")
    if seen:
        warnings.warn(
            f"roundpipe steps {type(optimizer).__name__} on the host with its unfused loop for {', '.join(seen)}:"
            f" torch {torch.__version__}'s fused CPU kernel did not reproduce the unfused step on a probe of"
            f" {PROBE_ELEMENTS} parameters (e.g. fused SGD leaves bf16 and fp16 parameters unchanged). Training is"
            " correct, the host step slower; fp32 master weights (precision='bf16-mixed') take the fused kernel.",
            stacklevel=outside_package(),
        )
    return refused


def _settings(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> dict[str, Any]:
    """The group's settings its class's constructor takes, without the parameters and the kernel choice."""
    return constructor_settings(type(optimizer), group)


def _key(settings: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """Hashable settings for the probe's cache (tensors by value; the learning rate is the probe's own)."""
    plain = lambda v: v.tolist() if isinstance(v, torch.Tensor) else tuple(v) if isinstance(v, list) else v  # noqa: E731
    return tuple(sorted((k, plain(v)) for k, v in settings.items() if k != "lr"))


@functools.cache
def fused_disagrees(cls: type, settings: tuple[tuple[str, Any], ...], dtype: torch.dtype) -> float | None:
    """How far ``cls``'s fused CPU kernel's three steps land from its unfused loop's, relative to the unfused
    update, on a probe of ``dtype``; ``None`` when they agree within rounding (:data:`DISAGREEMENT`) or the
    probe could not run. Once per class, settings and dtype: a few milliseconds."""
    g = torch.Generator().manual_seed(0)
    start = torch.randn(PROBE_ELEMENTS, generator=g)
    grads = [torch.randn(PROBE_ELEMENTS, generator=g) for _ in range(3)]
    moved = []
    try:
        for fused in (True, False):
            p = torch.nn.Parameter(start.to(dtype))
            scratch = cls([p], **dict(settings), lr=PROBE_LR, fused=fused, foreach=False)
            for grad in grads:
                p.grad = grad.to(dtype)
                scratch.step()
            moved.append(p.detach().double() - start.to(dtype).double())
    except Exception:  # settings the kernel refuses (the constructor would have said so to the user)
        return None
    fused, unfused = moved
    if not torch.isfinite(unfused).all():  # fp16 Adam's unfused loop overflows; the fused one computes in fp32
        return None
    if not torch.isfinite(fused).all():
        return 1.0
    difference = ((fused - unfused).norm() / unfused.norm().clamp_min(1e-30)).item()
    return difference if difference > DISAGREEMENT else None


def _warn_explicit_choice(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    name, group = type(optimizer).__name__, groups[0]
    choice = ", ".join(f"{k}={group[k]!r}" for k in ("fused", "foreach") if group.get(k) is not None)
    params = sum(p.numel() for g in groups for p in g["params"] if p.requires_grad)
    advice = (
        "Leave `fused` and `foreach` unset (roundpipe then uses the fused kernel) or pass fused=True, unless you"
        " need this choice."
    )
    try:  # one large scratch tensor: the loop's per-tensor overhead on a real model comes on top
        theirs = step_seconds(optimizer, group, fused=False) * params / CALIBRATION_ELEMENTS
        fused = step_seconds(optimizer, group, fused=True) * params / CALIBRATION_ELEMENTS
        cost = (
            f" takes at least {_seconds(theirs)} per step for these {_count(params)} parameters here, its fused CPU"
            f" kernel about {_seconds(fused)} (measured on {CALIBRATION_ELEMENTS / 2**20:.0f} Mi parameters)."
        )
    except Exception:  # a subclass with its own constructor, settings the fused kernel refuses
        cost = ", not torch's fused CPU kernel (several times faster for Adam, AdamW, SGD and Adagrad)."
    warnings.warn(
        f"roundpipe steps the optimizer on the host: {name}({choice}){cost} {advice}", stacklevel=outside_package()
    )


def _seconds(seconds: float) -> str:
    if seconds >= 0.1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.2g} ms" if seconds >= 1e-4 else f"{seconds * 1e6:.2g} µs"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.1f} M" if n >= 1e5 else f"{n:,}"


def step_seconds(optimizer: torch.optim.Optimizer, group: dict[str, Any], fused: bool) -> float:
    """One step of ``optimizer``'s class with ``group``'s settings on a scratch tensor (best of three)."""
    settings = _settings(optimizer, group)
    if fused:
        settings["fused"] = True
    else:
        settings["fused"], settings["foreach"] = group.get("fused"), group.get("foreach")
    p = torch.nn.Parameter(torch.zeros(CALIBRATION_ELEMENTS))
    p.grad = torch.full_like(p, 1e-3)
    scratch = type(optimizer)([p], **settings)
    scratch.step()  # state initialisation
    times = []
    for _ in range(3):
        start = time.perf_counter()
        scratch.step()
        times.append(time.perf_counter() - start)
    return min(times)
