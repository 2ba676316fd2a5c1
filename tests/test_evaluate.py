"""Forward-only passes through the pipeline: losses and outputs of the plain model, training untouched."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import relative_error
from test_engine import batch, mlp

from lightning_roundpipe.engine import PipelineEngine
from lightning_roundpipe.runtime import WorkerDevice
from lightning_roundpipe.runtime.updates import UpdateSpec
from lightning_roundpipe.schedule import StagePlan


def engine_for(model, asynchronous=False, plan="3,2|4,2,3", mbs=3, rounds=1, double_buffer=False):
    return PipelineEngine(
        list(model.children()), [WorkerDevice("cpu", i) for i in range(2)], plan=StagePlan.parse(plan),
        microbatches_per_round=mbs, num_rounds=rounds, asynchronous=asynchronous, double_buffer=double_buffer,
    )  # fmt: skip


@pytest.mark.parametrize("plan, mbs, rounds", [("3,2|4,2,3", 3, 1), ("1,1,1,1,1,1|3,3,3", 2, 2), ("|9", 2, 1)])
def test_loss_and_outputs_equal_the_plain_model(plan, mbs, rounds):
    model = mlp(dropout=0.3).eval()  # eval mode: dropout off, as validation runs it
    engine = engine_for(copy.deepcopy(model).eval(), plan=plan, mbs=mbs, rounds=rounds)
    x, y = batch(12)
    try:
        engine.begin_evaluation()
        loss = engine.evaluate(x, y, F.mse_loss)
        out = engine.evaluate(x)
        engine.end_evaluation()
        with torch.no_grad():
            want = model(x)
        assert relative_error(loss, F.mse_loss(want, y)) <= 1e-6
        assert out.shape == want.shape and relative_error(out, want) <= 1e-6
        assert all(g.grad is None or not g.grad.any() for g in engine.store.groups)  # no gradient written
        assert engine.calls == 0 and engine.dispatch_position == 0  # training counters untouched
    finally:
        engine.close()


@pytest.mark.parametrize("asynchronous, double_buffer", [(False, False), (True, False), (True, True)])
def test_evaluating_between_steps_sees_the_masters_and_changes_no_training_number(asynchronous, double_buffer):
    def train(evaluate_every_step: bool):
        torch.manual_seed(0)
        model = mlp()
        engine = engine_for(model, asynchronous=asynchronous, double_buffer=double_buffer)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        try:
            for step in range(4):
                x, y = batch(12, seed=step)
                engine.train_batch(x, y, F.mse_loss)
                if asynchronous:
                    engine.submit_step(UpdateSpec.capture(opt))
                else:
                    engine.store.install_grads()
                    opt.step()
                    engine.store.clear_grads()
                    engine.store.mark_dirty()
                if evaluate_every_step:
                    engine.begin_evaluation()
                    losses.append(engine.evaluate(*batch(12, seed=99), loss_fn=F.mse_loss))
                    engine.end_evaluation()
                    with torch.no_grad():  # the masters, as a plain model would be evaluated
                        assert (
                            relative_error(losses[-1], F.mse_loss(model(batch(12, seed=99)[0]), batch(12, 99)[1]))
                            < 1e-6
                        )
            engine.flush()
            return torch.cat([p.detach().flatten() for p in model.parameters()]), losses
        finally:
            engine.close()

    plain_weights, _ = train(False)
    weights, losses = train(True)
    assert torch.equal(weights, plain_weights)  # validation changed nothing in training
    assert len(losses) == 4 and losses[0] != losses[-1]


@pytest.mark.parametrize("size", [1, 2, 5])
def test_a_batch_smaller_than_the_microbatch_count_is_evaluated_whole(size):
    model = mlp().eval()
    engine = engine_for(copy.deepcopy(model).eval(), mbs=3, rounds=2)  # 6 micro-batches, 2 workers
    x, y = batch(size)
    try:
        loss, out = engine.evaluate(x, y, F.mse_loss), engine.evaluate(x)
    finally:
        engine.close()
    with torch.no_grad():
        want = model(x)
    assert relative_error(out, want) <= 1e-6 and relative_error(loss, F.mse_loss(want, y)) <= 1e-6


def test_a_microbatch_with_nothing_to_count_adds_nothing_to_the_evaluated_loss():
    model = mlp().eval()
    engine = engine_for(copy.deepcopy(model).eval())
    x = torch.randn(12, 6)
    labels = torch.randint(0, 3, (12,))
    labels[:4] = -100  # the first micro-batch holds only ignored targets

    def loss_fn(out, y):
        return F.cross_entropy(out, y, ignore_index=-100)

    try:
        got = engine.evaluate(x, labels, loss_fn, reduction=lambda y: (y != -100).sum())
    finally:
        engine.close()
    with torch.no_grad():
        want = loss_fn(model(x), labels)
    assert torch.isfinite(got) and relative_error(got, want) <= 1e-6
