"""AdamW's host step and the cast in one pass (``runtime/one_pass.py``): torch's AdamW to rounding, the
staleness-one reference through the engine, and the two passes wherever the kernel does not apply or fails."""

from __future__ import annotations

import bisect
import copy
import threading
import time

import pytest
import test_async
import torch
from helpers import BoringPipeline, fit, relative_error
from test_async import batches, mlp, run_async, staleness_one_reference
from test_resident import train_until_batch_five_fails

from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.engine import PipelineEngine
from lightning_roundpipe.runtime import WorkerDevice, one_pass
from lightning_roundpipe.runtime import optimizer_worker as optimizer_module
from lightning_roundpipe.runtime.compiles import compilations
from lightning_roundpipe.runtime.one_pass import OnePass, step_and_cast


@pytest.fixture(autouse=True)
def fresh_one_pass(monkeypatch):
    """Each test starts with the kernel on and unchecked (the class keeps a failure for the process)."""
    monkeypatch.setattr(OnePass, "_failed", None)
    monkeypatch.setattr(OnePass, "_checked", set())
    monkeypatch.setattr(OnePass, "enabled", True)


def counted(monkeypatch) -> list[int]:
    calls = [0]
    real = optimizer_module.step_and_cast

    def count(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(optimizer_module, "step_and_cast", count)
    return calls


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_the_kernel_equals_torchs_adamw_and_writes_the_cast(cls):
    """Two parameter groups with their own settings, the LR changed between steps: weights, moments and step
    counts equal torch's (its default and its fused kernel) to float32 rounding; ``out`` is the new weights in
    bf16."""
    torch.manual_seed(0)
    shapes = [(33, 7), (129,), (5, 3), (1,)]
    weights = [torch.randn(s) for s in shapes]
    settings = [dict(weight_decay=0.1 if cls is torch.optim.AdamW else 0.0, betas=(0.8, 0.99)), dict(eps=1e-6)]

    def optimizer(params, **extra):
        groups = [{"params": params[:2], **settings[0]}, {"params": params[2:], **settings[1]}]
        return cls(groups, lr=0.01, **extra)

    mine = [torch.nn.Parameter(w.clone()) for w in weights]
    ours = optimizer(mine)
    OnePass.compile({torch.bfloat16})
    assert OnePass.ready(ours, {torch.bfloat16})
    kernel = OnePass.kernel(ours.param_groups[0], torch.bfloat16)
    assert kernel is not None and OnePass.kernel(ours.param_groups[1], torch.bfloat16) is kernel
    references = {fused: [torch.nn.Parameter(w.clone()) for w in weights] for fused in (False, True)}
    theirs = {fused: optimizer(params, fused=fused) for fused, params in references.items()}
    outs = [torch.empty(w.numel(), dtype=torch.bfloat16) for w in weights]
    for step in range(4):
        grads = [torch.randn(s) for s in shapes]
        for opt, params in [(theirs[False], references[False]), (theirs[True], references[True])]:
            for p, g in zip(params, grads):
                p.grad = g.clone()
            for group in opt.param_groups:
                group["lr"] = 0.01 / (step + 1)
            opt.step()
        for group in ours.param_groups:
            group["lr"] = 0.01 / (step + 1)
        items = [
            (p, ours.param_groups[0 if i < 2 else 1], g.view(-1), o)
            for i, (p, g, o) in enumerate(zip(mine, grads, outs))
        ]
        step_and_cast(kernel, items, ours)
        for fused, params in references.items():
            for p, q in zip(mine, params):
                assert relative_error(p.detach(), q.detach()) <= 1e-6, fused
                s, r = ours.state[p], theirs[fused].state[q]
                assert float(s["step"]) == float(r["step"]) == step + 1
                assert relative_error(s["exp_avg_sq"], r["exp_avg_sq"]) <= 1e-6
                assert relative_error(s["exp_avg"], r["exp_avg"]) <= 1e-6
        for p, o in zip(mine, outs):
            assert torch.equal(o, p.detach().view(-1).to(torch.bfloat16))


def test_only_plain_adam_and_adamw_without_the_options_it_leaves_out_take_it():
    params = [torch.nn.Parameter(torch.zeros(3))]

    class Mine(torch.optim.AdamW):
        pass

    assert OnePass.usable(torch.optim.AdamW(params)) and OnePass.usable(torch.optim.Adam(params))
    assert not OnePass.usable(Mine(params)) and not OnePass.usable(torch.optim.SGD(params, lr=0.1))

    def settles(optimizer):
        return OnePass.settles(optimizer.param_groups[0], optimizer)

    assert settles(torch.optim.AdamW(params, weight_decay=0.1)) and settles(torch.optim.Adam(params))
    assert settles(torch.optim.Adam(params, weight_decay=0.1, decoupled_weight_decay=True))
    assert not settles(torch.optim.Adam(params, weight_decay=0.1))  # L2, in the gradient
    for option in ("amsgrad", "maximize"):
        assert not settles(torch.optim.AdamW(params, **{option: True}))
    OnePass.enabled = False
    assert not OnePass.usable(torch.optim.AdamW(params))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_double_buffered_updates_take_the_kernel_and_equal_the_staleness_one_reference(monkeypatch, dtype):
    """Every group's update of every step but the engine's own first casts goes through the kernel; the weights
    equal the reference, and the two passes (the kernel off) to float32 rounding."""
    model, data = mlp(), batches(5, 2)
    kwargs = dict(microbatches_per_round=2, double_buffer=True, last_of_step=True)
    if dtype is not None:
        kwargs.update(compute_dtype=dtype, autocast_dtype=dtype)
    calls = counted(monkeypatch)
    got, _ = run_async(copy.deepcopy(model), data, **kwargs)
    assert calls[0] == 5 * 4  # five updates of four trainable groups (one per Linear)
    OnePass.enabled = False
    two_passes, _ = run_async(copy.deepcopy(model), data, **kwargs)
    assert calls[0] == 20
    assert relative_error(got, two_passes) <= 1e-6
    if dtype is None:
        assert relative_error(got, staleness_one_reference(model, data)) <= 1e-5


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("spares", "decoupled", "takes_it"), [(False, True, False), (True, False, False), (True, True, True)]
)
def test_adam_takes_it_with_spares_and_decoupled_decay_only(monkeypatch, spares, decoupled, takes_it):
    """Without spares the single compute copy is cast after the next step's last read of it, so the math cannot
    carry the cast; Adam's L2 decay (added to the gradient) is not the kernel's. Each way the weights equal torch's
    Adam with the same settings, stepped with staleness one."""
    model, data = mlp(), batches(4)
    calls = counted(monkeypatch)
    settings = dict(lr=0.05, weight_decay=0.1, decoupled_weight_decay=decoupled)
    monkeypatch.setattr(test_async, "make_optimizer", lambda params, kind="adamw": torch.optim.Adam(params, **settings))
    got, _ = run_async(copy.deepcopy(model), data, double_buffer=spares)
    assert calls[0] == (4 * 4 if takes_it else 0)
    assert relative_error(got, staleness_one_reference(model, data)) <= 1e-5


@pytest.mark.timeout(120)
@pytest.mark.parametrize("failure", ["compile", "numerics"])
def test_a_kernel_that_fails_or_differs_is_turned_off_with_a_warning(monkeypatch, failure):
    """A build that raises (no C++ compiler), or a kernel whose first check against torch's AdamW differs:
    a warning, then the two passes for the process, and the weights still equal the reference."""
    model, data = mlp(), batches(4)
    monkeypatch.setattr(OnePass, "_kernel", None)
    if failure == "compile":

        def broken():
            raise RuntimeError("no C++ compiler")

        monkeypatch.setattr(one_pass, "_build", broken)
    else:

        def wrong(p, grad, avg, avg_sq, out, *scalars):
            p.sub_(0.1 * grad)
            out.copy_(p)

        monkeypatch.setattr(OnePass, "_kernel", wrong)
    calls = counted(monkeypatch)
    with pytest.warns(UserWarning, match="one-pass AdamW and cast is off"):
        got, _ = run_async(copy.deepcopy(model), data, double_buffer=True)
    assert calls[0] == 0 and OnePass._failed is not None
    assert relative_error(got, staleness_one_reference(model, data)) <= 1e-5


@pytest.mark.timeout(120)
def test_the_kernel_runs_while_another_thread_traces_and_under_other_settings_and_compiles_nothing(monkeypatch):
    """A function compiled by ``torch.compile`` refuses to run while any thread traces with FX (seen on an H100: a
    worker compiling a new plan's blocks beside an update), and compiles again under settings its guards read
    (matmul precision): the kernel's first two forms had to wait, or run eagerly. The C++ kernel does neither: the
    bits equal a calm run's and nothing compiles."""
    model, data = mlp(), batches(3)
    calm, _ = run_async(copy.deepcopy(model), data, double_buffer=True)
    started, calls = compilations(), counted(monkeypatch)
    precision = torch.get_float32_matmul_precision()
    monkeypatch.setattr(torch.fx._symbolic_trace, "_is_fx_tracing_flag", True)
    torch.set_float32_matmul_precision("medium" if precision != "medium" else "high")
    try:
        got, _ = run_async(copy.deepcopy(model), data, double_buffer=True)
    finally:
        torch.set_float32_matmul_precision(precision)
    assert compilations() == started and calls[0] == 3 * 4
    assert torch.equal(got, calm)


@pytest.mark.timeout(60)
def test_a_failure_in_the_next_batch_lets_the_one_pass_update_finish_with_the_bits_of_a_run_without_it(monkeypatch):
    """An abort while the update of the step before runs (its gradients all landed): the one pass cannot wait for
    the aborted step's reads of the copy it writes, so the same kernel casts into a scratch copy. The module holds
    whole steps with the bits of a run the failure never touched (torch's step, once taken here, differed in the
    last bits: a checkpoint written after a failure did not equal the one of an uninterrupted run)."""
    model, data = mlp(), batches(5)
    make = lambda params, kind="adamw": torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)  # noqa: E731
    monkeypatch.setattr(test_async, "make_optimizer", make)
    want, _ = run_async(copy.deepcopy(model), data[:4], workers=1, double_buffer=True)
    calls, released = counted(monkeypatch), []
    waited = optimizer_module._released
    monkeypatch.setattr(optimizer_module, "_released", lambda *a: (answer := waited(*a), released.append(answer))[0])
    one, rest = optimizer_module.step_and_cast, optimizer_module.OptimizerWorker._step_groups
    monkeypatch.setattr(optimizer_module, "step_and_cast", lambda *a: (time.sleep(0.06), one(*a))[1])
    monkeypatch.setattr(
        optimizer_module.OptimizerWorker, "_step_groups",
        lambda self, shadow, groups: (time.sleep(0.06 if groups else 0), rest(self, shadow, groups))[1],
    )  # fmt: skip
    engine = PipelineEngine(list(model.children()), [WorkerDevice("cpu")], asynchronous=True, double_buffer=True)
    train_until_batch_five_fails(engine, make(model.parameters()), data)  # 4 groups x 60 ms to go when batch 5 fails
    assert engine.crew.optimizer.cut_short is None
    assert calls[0] == 4 * 4  # every group of the four updates, the last's after the abort too
    assert False in released  # (some group's update came after the abort: the path under test ran)
    assert torch.equal(torch.cat([p.detach().flatten() for p in model.parameters()]), want)


class _SgdPipeline(BoringPipeline):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("module", "compile_option", "compiles"),
    [(BoringPipeline, "auto", True), (_SgdPipeline, "auto", False), (BoringPipeline, False, False)],
)
def test_the_strategy_compiles_the_kernel_only_for_an_optimizer_that_can_take_it(
    monkeypatch, module, compile_option, compiles
):
    """Through ``Trainer`` with ``double_buffer="all"``: AdamW's engine compiles the kernel when built; SGD's does not
    (no compile to wait for, no C++ compiler needed), nor does one under ``compile=False`` (no Inductor wanted)."""
    asked = []
    monkeypatch.setattr(OnePass, "compile", classmethod(lambda cls, dtypes: asked.append(set(dtypes))))
    strategy = RoundPipeStrategy(num_microbatches=2, double_buffer="all", compile=compile_option)
    fit(module, dict(strategy=strategy, accelerator="cpu", devices=2, max_steps=2))
    assert bool(asked) == compiles


@pytest.mark.timeout(120)
def test_the_kernel_lets_go_of_the_gil_and_casts_into_each_dtype_as_torch():
    """The C++ kernel runs through ``ctypes``, which releases the GIL, so another thread runs Python during a call
    (Inductor's kernels, the earlier form, keep the GIL: the workers could launch nothing while the host step ran).
    Its updates equal torch's fused AdamW's, from either end of torch's lerp, cast into bf16, fp16 or fp32."""
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    OnePass.compile(set(dtypes))
    assert OnePass._failed is None and OnePass._kernel is not None
    for dtype in dtypes:
        for beta1 in (0.9, 0.3):  # lerp's weight 1 - beta1 under and over one half
            assert one_pass._check(OnePass._kernel, beta1, 0.99, 1e-8, 0.01, dtype) <= 1e-4
    n = 1 << 25
    tensors = [torch.zeros(n) for _ in range(4)] + [torch.empty(n, dtype=torch.bfloat16)]
    scalars = one_pass._scalars(1e-3, 0.01, 0.9, 0.999, 1.0, 1e-8)
    seen, stop = [], threading.Event()

    def python() -> None:
        while not stop.is_set():
            seen.append(time.perf_counter())

    thread = threading.Thread(target=python)
    thread.start()
    ran = []
    try:
        while not seen:
            time.sleep(0.001)
        for _ in range(4):  # (Inductor's kernel: 1 call of 5 at most, where the call's Python part reached the middle)
            start = time.perf_counter()
            OnePass._kernel(*tensors, *scalars)
            end = time.perf_counter()
            quarter = (end - start) / 4
            first = bisect.bisect_right(seen, start + quarter)
            ran.append(first < len(seen) and seen[first] < end - quarter)
    finally:
        stop.set()
        thread.join()
    assert sum(ran) >= 3, ran  # the other thread ran in the middle half of the calls


def test_the_kernel_refuses_tensors_it_would_misread_before_counting_the_step():
    """The kernel writes through raw pointers: a tensor of another length, layout, dtype or a lazy view is refused
    with an error, the optimizer's step count untouched; the library runs its loop in OpenMP's parallel regions
    (built without them it would run on one thread, as Inductor's first form did)."""
    from pathlib import Path

    OnePass.compile({torch.bfloat16})
    kernel = OnePass._kernel
    assert kernel is not None, OnePass._failed
    library = Path(kernel.path).read_bytes()
    assert b"GOMP_parallel" in library or b"__kmpc_fork_call" in library
    p = torch.nn.Parameter(torch.zeros(8))
    optimizer = torch.optim.AdamW([p])
    group = optimizer.param_groups[0]
    good = [torch.zeros(8), torch.empty(8, dtype=torch.bfloat16)]
    for grad, out in [
        (torch.zeros(9), good[1]),  # another length
        (torch.zeros(16)[::2], good[1]),  # strided
        (torch.zeros(8, dtype=torch.float64), good[1]),
        (torch.zeros(8)._neg_view(), good[1]),  # a lazy negation
        (torch.zeros(8, requires_grad=True), good[1]),
        (good[0], torch.empty(8, dtype=torch.float64)),  # a copy it does not cast into
    ]:
        with pytest.raises(ValueError, match="one-pass kernel takes"):
            step_and_cast(kernel, [(p, group, grad, out)], optimizer)
        assert float(optimizer.state[p]["step"]) == 0
    step_and_cast(kernel, [(p, group, *good)], optimizer)
    assert float(optimizer.state[p]["step"]) == 1
