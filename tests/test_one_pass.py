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


def counted_eager(monkeypatch) -> list[int]:
    """How many parameters' updates ran the kernel's arithmetic in eager torch."""
    calls = [0]
    arithmetic = one_pass._adamw_and_cast

    def count(*args):
        calls[0] += 1
        return arithmetic(*args)

    monkeypatch.setattr(one_pass, "_adamw_and_cast", count)
    return calls


def use_native(monkeypatch, native: bool) -> None:
    """The C++ kernel (``OnePass.native``) built afresh for this test; the class keeps Inductor's for the others."""
    if native:
        monkeypatch.setattr(OnePass, "native", True)
        monkeypatch.setattr(OnePass, "_kernel", None)
        monkeypatch.setattr(OnePass, "_compiled", set())


def counted(monkeypatch) -> list[int]:
    calls = [0]
    real = optimizer_module.step_and_cast

    def count(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(optimizer_module, "step_and_cast", count)
    return calls


@pytest.mark.timeout(120)
@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_the_kernel_equals_torchs_adamw_and_writes_the_cast(monkeypatch, cls, native):
    """Two parameter groups with their own settings, the LR changed between steps: weights, moments and step
    counts equal torch's (its default and its fused kernel) to float32 rounding; ``out`` is the new weights in
    bf16. Inductor's kernel and the C++ one (``OnePass.native``)."""
    use_native(monkeypatch, native)
    torch.manual_seed(0)
    shapes = [(33, 7), (129,), (5, 3)]
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
@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_double_buffered_updates_take_the_kernel_and_equal_the_staleness_one_reference(monkeypatch, dtype, native):
    """Every group's update of every step but the engine's own first casts goes through the kernel; the weights
    equal the reference, and the two passes (the kernel off) to float32 rounding. Inductor's kernel and the C++ one
    (built when the engine is)."""
    use_native(monkeypatch, native)
    model, data = mlp(), batches(5, 2)
    kwargs = dict(microbatches_per_round=2, double_buffer=True, last_of_step=True)
    if dtype is not None:
        kwargs.update(compute_dtype=dtype, autocast_dtype=dtype)
    calls, eager = counted(monkeypatch), counted_eager(monkeypatch)
    got, _ = run_async(copy.deepcopy(model), data, **kwargs)
    assert calls[0] == 5 * 4 and eager[0] == 0  # five updates of four trainable groups (one per Linear), compiled
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
    """A compile that raises (no C++ compiler), or a kernel whose first check against torch's AdamW differs:
    a warning, then the two passes for the process, and the weights still equal the reference."""
    model, data = mlp(), batches(4)
    monkeypatch.setattr(OnePass, "_kernel", None)
    monkeypatch.setattr(OnePass, "_compiled", set())
    if failure == "compile":

        def broken(*args, **kwargs):
            raise RuntimeError("no C++ compiler")

        monkeypatch.setattr(one_pass.torch, "compile", broken)
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
@pytest.mark.parametrize(
    "when", ["before the call", "between the looks", "during the call", "at the submission's check"]
)
def test_while_another_thread_traces_the_kernel_waits_and_the_bits_are_the_same(monkeypatch, when):
    """A compiled function called while any thread traces with FX (a worker compiling a block) refuses to run: seen
    on an H100 when a new plan's blocks compiled beside an update. The call waits for the trace to end and runs the
    same kernel: the weights equal a run with no trace bit for bit."""
    model, data = mlp(), batches(4)
    OnePass.compile({torch.float32})
    calm, _ = run_async(copy.deepcopy(model), data, double_buffer=True)
    seen = {"looks": 0}
    thread = threading.main_thread().name if when == "at the submission's check" else "roundpipe-optimizer"

    def tracing_a_while() -> bool:  # a trace seen by the first 20 looks from that thread, then over
        if threading.current_thread().name != thread:
            return False
        seen["looks"] += 1
        if when == "between the looks":  # begun after the wait's look, seen by the look before the call
            return seen["looks"] in (2, 5, 8)
        return seen["looks"] <= 20

    monkeypatch.setattr(OnePass, "_checked", set())
    if when == "during the call":  # the trace begins between the look and the call: dynamo's refusal, 3 times
        real = OnePass._kernel

        def refusing(*args):
            if threading.current_thread().name == thread and seen["looks"] < 3:
                seen["looks"] += 1
                raise RuntimeError("Detected that you are using FX to symbolically trace a dynamo-optimized function.")
            return real(*args)

        monkeypatch.setattr(OnePass, "_kernel", refusing)
    else:
        monkeypatch.setattr(one_pass, "traced_elsewhere", tracing_a_while)
    eager, calls = counted_eager(monkeypatch), counted(monkeypatch)
    got, _ = run_async(copy.deepcopy(model), data, double_buffer=True)
    assert seen["looks"] >= 3 and calls[0] == 4 * 4 and eager[0] == 0
    assert torch.equal(got, calm)


@pytest.mark.timeout(120)
def test_a_trace_longer_than_the_limit_runs_the_update_eagerly_with_a_warning(monkeypatch):
    model, data = mlp(), batches(3)
    OnePass.compile({torch.float32})
    monkeypatch.setattr(one_pass, "WAIT_LIMIT_S", 0.05)
    monkeypatch.setattr(OnePass, "_waited_out", False)
    monkeypatch.setattr(one_pass, "traced_elsewhere", lambda: threading.current_thread().name == "roundpipe-optimizer")
    eager = counted_eager(monkeypatch)
    with pytest.warns(UserWarning, match="ran in eager torch meanwhile"):
        got, _ = run_async(copy.deepcopy(model), data, double_buffer=True)
    assert eager[0] == 3 * 8  # every parameter of every update (a weight and a bias a Linear)
    assert relative_error(got, staleness_one_reference(model, data)) <= 1e-5


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


@pytest.mark.timeout(120)
def test_a_setting_changed_after_the_compile_runs_the_update_eagerly_and_compiles_nothing(monkeypatch):
    """The kernel's guards read settings of the process (matmul precision, default dtype) and of the calling thread
    (its thread count): under others a call would compile again, and a compile off the main thread sets the FX flag
    that makes the workers' compiled blocks refuse to run. Such a call runs the same arithmetic eagerly instead."""
    model, data = mlp(), batches(3)
    OnePass.compile({torch.float32})
    started = compilations()
    precision = torch.get_float32_matmul_precision()
    eager, calls = counted_eager(monkeypatch), counted(monkeypatch)
    torch.set_float32_matmul_precision("medium" if precision != "medium" else "high")
    try:
        got, _ = run_async(copy.deepcopy(model), data, double_buffer=True)
    finally:
        torch.set_float32_matmul_precision(precision)
    assert compilations() == started
    assert calls[0] == 3 * 4 and eager[0] >= 3 * 8  # every parameter of every update (and the submission's check)
    assert relative_error(got, staleness_one_reference(model, data)) <= 1e-5


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


_GENERATED_CODE = """
import torch
from unittest import mock
from torch._inductor.graph import GraphLowering
from lightning_roundpipe.runtime import one_pass
from lightning_roundpipe.runtime.one_pass import OnePass

torch.set_num_threads(2)  # (Inductor reads the count when it generates the code)
serial = torch.compile(one_pass._adamw_and_cast, fullgraph=True, dynamic=True)  # the first form: 67 elements
scalars = one_pass._scalars(1e-3, 0.0, 0.9, 0.999, 1.0, 1e-8)
with torch.no_grad():
    serial(*[torch.zeros(67) for _ in range(4)], torch.empty(67, dtype=torch.bfloat16), *scalars)
torch._dynamo.reset()  # (Inductor's cache, on disk, keeps the serial kernel)
codes = []
with mock.patch.object(GraphLowering, "save_output_code", codes.append):
    OnePass.compile({torch.bfloat16})
assert OnePass._failed is None and codes, OnePass._failed
print("PARALLEL" if all("#pragma omp parallel" in code for code in codes) else "SERIAL")
"""


@pytest.mark.timeout(240)
def test_the_compiled_kernel_splits_its_loop_over_the_threads(tmp_path):
    """Inductor decides at compile time whether a loop runs on several threads, from the example's length (the
    dynamic size's hint): a kernel compiled on 67 elements ran every group on one thread, 2.8 s a step on an H100's
    host against torch's fused AdamW's 0.58 (2026-12-07). Its cache keys on no length, so a serial kernel compiled
    before must not be served again. In a fresh process, with a cache of its own."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", _GENERATED_CODE], capture_output=True, text=True, env=env, timeout=230)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == "PARALLEL"


@pytest.mark.timeout(120)
def test_the_native_kernel_lets_go_of_the_gil_and_casts_into_each_dtype_as_torch(monkeypatch):
    """``OnePass.native``: the C++ kernel runs through ``ctypes``, which releases the GIL, so another thread runs
    Python during a call (Inductor's kernels keep the GIL: the workers could launch nothing while the host step ran).
    Its updates equal torch's fused AdamW's, from either end of torch's lerp, cast into bf16, fp16 or fp32."""
    use_native(monkeypatch, True)
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    OnePass.compile(set(dtypes))
    assert OnePass._failed is None and OnePass._compiled == set(dtypes)
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
            one_pass.run_compiled(OnePass._kernel, *tensors, *scalars)  # (as the optimizer thread calls it)
            end = time.perf_counter()
            quarter = (end - start) / 4
            first = bisect.bisect_right(seen, start + quarter)
            ran.append(first < len(seen) and seen[first] < end - quarter)
    finally:
        stop.set()
        thread.join()
    assert sum(ran) >= 3, ran  # the other thread ran in the middle half of the calls
