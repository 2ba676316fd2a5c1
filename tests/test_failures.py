"""A failing worker: the original exception reaches the main thread quickly, nothing hangs, and the
engine (or a new fit) works again afterwards."""

from __future__ import annotations

import copy
import threading
import time
import traceback

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_roundpipe.runtime import PipelineEngine, WorkerDevice
from lightning_roundpipe.schedule import StagePlan


class Boom(RuntimeError):
    pass


class FailingLayer(nn.Module):
    """Raises in forward (or recompute, or backward) once armed."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.where = where
        self.armed = False

    def forward(self, x):
        y = self.linear(x)
        if self.armed and self.where == "forward":
            raise Boom("injected forward failure")
        if self.armed and self.where == "recompute" and torch.is_grad_enabled():
            raise Boom("injected recompute failure")
        if self.armed and self.where == "backward":
            return _FailInBackward.apply(y)
        return y


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise Boom("injected backward failure")


def build(where: str) -> tuple[nn.Sequential, FailingLayer]:
    torch.manual_seed(0)
    bad = FailingLayer(where)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), bad, nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 2))
    return model, bad


def roundpipe_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("roundpipe-worker")]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("where", ["forward", "recompute", "backward", "loss"])
def test_worker_exception_reaches_main_thread_with_traceback(where):
    model, bad = build(where)
    reference = copy.deepcopy(model)
    # layer 2 runs forward-only in slot 0, is recomputed in a backward stage
    engine = PipelineEngine(
        list(model.children()),
        [WorkerDevice("cpu", i) for i in range(3)],
        plan=StagePlan.parse("3,1|2,2,2"),
        microbatches_per_round=3,
        num_rounds=2,
    )
    x, y = torch.randn(12, 4), torch.randn(12, 2)

    def loss_fn(out, target):
        if where == "loss":
            raise Boom("injected loss failure")
        return F.mse_loss(out, target)

    try:
        engine.train_batch(x, y, F.mse_loss)  # healthy first
        engine.store.clear_grads()
        bad.armed = True
        start = time.monotonic()
        with pytest.raises(Boom, match=f"injected {where} failure") as info:
            engine.train_batch(x, y, loss_fn)
        assert time.monotonic() - start < 10
        text = "".join(traceback.format_exception(info.value))
        assert "raised by roundpipe worker" in text
        assert ("def forward" in text or "def backward" in text or "def loss_fn" in text) or "raise Boom" in text
        # the engine recovered: nothing of the failed batch leaks into the next one, which is exact
        bad.armed = False
        engine.train_batch(x, y, F.mse_loss)
        engine.store.install_grads()
        got = [p.grad.clone() for p in engine.store.parameters]
        reference.zero_grad()
        F.mse_loss(reference(x), y).backward()
        for a, b in zip(got, reference.parameters()):
            assert torch.allclose(a, b.grad, rtol=1e-5, atol=1e-7)
    finally:
        engine.close()
    deadline = time.monotonic() + 5
    while roundpipe_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not roundpipe_threads()


@pytest.mark.timeout(30)
def test_non_scalar_loss_is_a_clear_error():
    model, _ = build("forward")
    engine = PipelineEngine(list(model.children()), [WorkerDevice("cpu", i) for i in range(2)])
    try:
        with pytest.raises(ValueError, match=r"loss_fn must return a scalar tensor, got \(2, 2\)"):
            engine.train_batch(torch.randn(6, 4), torch.randn(6, 2), lambda out, t: (out - t)[:2])
    finally:
        engine.close()


@pytest.mark.timeout(30)
def test_closed_engine_refuses_work():
    model, _ = build("forward")
    engine = PipelineEngine(list(model.children()), [WorkerDevice("cpu", 0)])
    engine.close()
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.train_batch(torch.randn(2, 4), torch.randn(2, 2), F.mse_loss)
