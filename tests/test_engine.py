"""The engine's gradients equal those of plain autograd on the unpipelined model."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import relative_error
from torch import nn

from lightning_roundpipe.engine import PipelineEngine
from lightning_roundpipe.runtime import WorkerDevice, layer_seed
from lightning_roundpipe.schedule import StagePlan


def mlp(seed: int = 0, dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 16),
        nn.Tanh(),
        nn.Dropout(dropout),
        nn.Linear(16, 16),
        nn.ReLU(inplace=True),
        nn.Linear(16, 16),
        nn.Dropout(dropout),
        nn.GELU(),
        nn.Linear(16, 3),
    )


def engine_for(model: nn.Sequential, workers: int, **kwargs) -> PipelineEngine:
    devices = [WorkerDevice("cpu", i) for i in range(workers)]
    return PipelineEngine(list(model.children()), devices, **kwargs)


def engine_grads(engine: PipelineEngine) -> list[torch.Tensor]:
    engine.store.install_grads()
    grads = [p.grad.clone() for p in engine.store.parameters if p.requires_grad]
    engine.store.clear_grads()
    return grads


def plain_grads(model: nn.Module, x, y, loss_fn=F.mse_loss) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]


def batch(n: int = 12, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


def assert_close(got: list[torch.Tensor], want: list[torch.Tensor], tol: float = 1e-5) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert relative_error(a, b) <= tol, f"tensor {i}: relative error {relative_error(a, b):.3g}"


@pytest.mark.parametrize(
    ("workers", "mbs", "rounds", "plan"),
    [
        (1, 1, 1, None),
        (1, 3, 2, "3,3|3,3,3"),
        (2, 3, 1, "3,3|3,3,3"),
        (2, 2, 3, "4,2,1|2,3,4"),  # forward and backward partitions differ
        (3, 4, 1, "|9"),  # one fused stage holding every layer
        (3, 3, 2, "8|1,8"),  # one forward stage, a one-layer fused stage
        (3, 5, 1, "1,1,1,1,1,1,1,1|1,1,1,1,1,1,1,1,1"),
    ],
)
def test_gradients_equal_plain_autograd(workers, mbs, rounds, plan):
    model = mlp()
    reference = copy.deepcopy(model)
    x, y = batch(12)
    engine = engine_for(
        model, workers, plan=plan and StagePlan.parse(plan), microbatches_per_round=mbs, num_rounds=rounds
    )
    try:
        loss = engine.train_batch(x, y, F.mse_loss)
        want_loss, want = plain_grads(reference, x, y)
        assert torch.allclose(loss, want_loss, rtol=1e-6, atol=0)
        assert_close(engine_grads(engine), want)
    finally:
        engine.close()


def test_uneven_microbatches_and_accumulation_over_batches():
    model = mlp()
    reference = copy.deepcopy(model)
    engine = engine_for(model, 2, microbatches_per_round=3)
    try:
        batches = [batch(7, seed=s) for s in (1, 2)]
        for x, y in batches:  # 7 samples into 3 micro-batches: 3, 2, 2
            engine.train_batch(x, y, F.mse_loss, grad_scale=0.5)
        reference.zero_grad()
        for x, y in batches:
            (F.mse_loss(reference(x), y) * 0.5).backward()
        assert_close(engine_grads(engine), [p.grad for p in reference.parameters()])
        assert engine.calls == 2
    finally:
        engine.close()


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("explicit", [False, True])
def test_a_batch_smaller_than_the_microbatch_count_runs_as_fewer_and_equals_plain_autograd(workers, explicit):
    """A last batch shorter than the count, and batches of one sample (fewer micro-batches than workers):
    each runs as fewer micro-batches, with the plain gradients; a count the user gave warns once."""
    model = mlp()
    reference = copy.deepcopy(model)
    kwargs = dict(microbatches_per_round=max(4, workers), num_rounds=2) if explicit else {}
    engine = engine_for(model, workers, plan="3,3,2|1,2,2,2,2", **kwargs)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for size in (8, 5, 1, 2, 1):
                x, y = batch(size, seed=size)
                loss = engine.train_batch(x, y, F.mse_loss)
                want_loss, want = plain_grads(reference, x, y)
                assert relative_error(loss, want_loss) <= 1e-6
                assert_close(engine_grads(engine), want)
        lowered = [w for w in seen if "cannot be cut into" in str(w.message)]
        assert len(lowered) == (1 if explicit else 0)
    finally:
        engine.close()


def test_token_loss_normalised_by_counted_items():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 11))
    reference = copy.deepcopy(model)
    tokens = torch.randint(0, 11, (6, 5))
    labels = torch.randint(0, 11, (6, 5))
    labels[0, :4] = -100  # micro-batches get different numbers of counted tokens
    labels[3:5, 1:] = -100

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)

    engine = engine_for(model, 2, microbatches_per_round=3, plan=StagePlan.parse("1,1|2,2"))
    try:
        loss = engine.train_batch(tokens, labels, loss_fn, reduction=lambda t: (t != -100).sum())
        want_loss, want = plain_grads(reference, tokens, labels, loss_fn)
        assert torch.allclose(loss, want_loss, rtol=1e-6)
        assert_close(engine_grads(engine), want)
    finally:
        engine.close()


def test_microbatch_with_nothing_to_count_adds_nothing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5))
    reference = copy.deepcopy(model)
    tokens = torch.randint(0, 5, (4, 3))
    labels = torch.randint(0, 5, (4, 3))
    labels[2:] = -100  # the second micro-batch has no counted token at all

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)

    engine = engine_for(model, 2, microbatches_per_round=2)
    try:
        loss = engine.train_batch(tokens, labels, loss_fn, reduction=lambda t: (t != -100).sum())
        want_loss, want = plain_grads(reference, tokens, labels, loss_fn)
        assert torch.isfinite(loss) and torch.allclose(loss, want_loss, rtol=1e-6)
        assert_close(engine_grads(engine), want)
    finally:
        engine.close()


class Split(nn.Module):
    """Turns a tensor into a (features, integer mask) pair: activations that are not one tensor."""

    def forward(self, x):
        return x, (x[:, :1] > 0).long()


class Masked(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, pair):
        x, mask = pair
        return torch.tanh(self.linear(x)) * (1 + mask), mask


class Merge(nn.Module):
    def forward(self, pair):
        x, mask = pair
        return x.sum(-1, keepdim=True) + mask


def test_tuple_activations_with_integer_leaves():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), Split(), Masked(8), Masked(8), Merge())
    reference = copy.deepcopy(model)
    x, _ = batch(8)
    y = torch.randn(8, 1)
    engine = engine_for(model, 2, microbatches_per_round=2, plan=StagePlan.parse("2,2|1,1,1,2"))
    try:
        engine.train_batch(x, y, F.mse_loss)
        assert_close(engine_grads(engine), plain_grads(reference, x, y)[1])
    finally:
        engine.close()


def test_frozen_parameters_get_no_gradient_buffer():
    model = mlp()
    model[0].requires_grad_(False)
    reference = copy.deepcopy(model)
    x, y = batch()
    engine = engine_for(model, 2, microbatches_per_round=2)
    try:
        engine.train_batch(x, y, F.mse_loss)
        engine.store.install_grads()
        assert model[0].weight.grad is None
        frozen = [g for g in engine.store.groups if g.layer == 0]
        assert frozen and all(g.grad is None for g in frozen)
        got = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        _, want = plain_grads(reference, x, y)
        assert_close(got, want)
    finally:
        engine.close()


def test_tied_parameters_across_stages_get_one_summed_gradient():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    model[2].weight = model[0].weight  # shared between a forward stage and a backward stage
    reference = copy.deepcopy(model)
    x, y = batch()
    engine = engine_for(model, 3, microbatches_per_round=3, plan=StagePlan.parse("2,1|2,1,1,1"))
    try:
        engine.train_batch(x, y, F.mse_loss)
        assert len(engine.store.parameters) == len(list(reference.parameters()))
        assert_close(engine_grads(engine), plain_grads(reference, x, y)[1])
    finally:
        engine.close()


def seeded_reference_grads(model, x, y, base_seed, call, num_microbatches):
    """Plain autograd, no recompute, micro-batch by micro-batch, each layer seeded as the engine seeds it."""
    model.zero_grad(set_to_none=True)
    xs, ys = torch.tensor_split(x, num_microbatches), torch.tensor_split(y, num_microbatches)
    for m, (xm, ym) in enumerate(zip(xs, ys)):
        h = xm
        for i, layer in enumerate(model):
            torch.manual_seed(layer_seed(base_seed, call, m, i))
            h = layer(h)
        (F.mse_loss(h, ym) * (len(xm) / len(x))).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_recompute_replays_dropout_masks():
    model = mlp(dropout=0.5)
    reference = copy.deepcopy(model)
    no_dropout = copy.deepcopy(model)
    x, y = batch(12)
    # dropout layers 2 and 6 sit in forward stages and are recomputed by backward stages whose
    # boundaries differ from the forward ones
    engine = engine_for(model, 3, microbatches_per_round=3, num_rounds=2, plan=StagePlan.parse("2,3|4,2,3"), seed=1234)
    try:
        for call in range(2):
            engine.train_batch(x, y, F.mse_loss)
            got = engine_grads(engine)
            assert_close(got, seeded_reference_grads(reference, x, y, 1234, call, 6))
        no_dropout[2].p = no_dropout[6].p = 0.0
        _, undropped = plain_grads(no_dropout, x, y)
        assert relative_error(got[0], undropped[0]) > 1e-2, "dropout had no effect: the test proves nothing"
    finally:
        engine.close()


def test_attribute_changes_between_batches_reach_the_workers():
    model = mlp(dropout=0.5)
    reference = copy.deepcopy(model)
    x, y = batch(12)
    engine = engine_for(model, 2, microbatches_per_round=2)
    try:
        engine.train_batch(x, y, F.mse_loss)
        engine.store.clear_grads()
        model[2].p = model[6].p = 0.0  # switch dropout off on the user's module
        model[7].approximate = "tanh"
        reference[2].p = reference[6].p = 0.0
        reference[7].approximate = "tanh"
        engine.train_batch(x, y, F.mse_loss)
        assert_close(engine_grads(engine), plain_grads(reference, x, y)[1])
        model.eval()  # eval mode also switches dropout off
        model[2].p = model[6].p = 0.5
        engine.train_batch(x, y, F.mse_loss)
        assert_close(engine_grads(engine), plain_grads(reference, x, y)[1])
    finally:
        engine.close()


def test_same_seed_gives_bitwise_identical_gradients():
    results = []
    for _ in range(2):
        model = mlp(dropout=0.3)
        engine = engine_for(model, 3, microbatches_per_round=4, num_rounds=2, seed=7)
        try:
            for s in range(3):
                engine.train_batch(*batch(16, seed=s), F.mse_loss)
            results.append(engine_grads(engine))
        finally:
            engine.close()
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_bf16_autocast_on_workers_is_close_to_fp32():
    model = mlp()
    reference = copy.deepcopy(model)
    x, y = batch(16)
    engine = engine_for(model, 2, microbatches_per_round=2, compute_dtype=torch.bfloat16, autocast_dtype=torch.bfloat16)
    try:
        engine.train_batch(x, y, F.mse_loss)
        got = engine_grads(engine)
        assert all(g.dtype == torch.float32 for g in got)
        _, want = plain_grads(reference, x, y)
        assert_close(got, want, tol=5e-2)
    finally:
        engine.close()


def test_batch_that_cannot_be_split_is_refused_in_the_main_thread():
    engine = engine_for(mlp(), 2, microbatches_per_round=4, num_rounds=2)
    try:
        with pytest.raises(ValueError, match=r"a batch of 0 samples has nothing to train on"):
            engine.train_batch(torch.randn(0, 6), torch.randn(0, 3), F.mse_loss)
        with pytest.raises(ValueError, match=r"inputs hold 8 samples but the target holds 9"):
            engine.train_batch(torch.randn(8, 6), torch.randn(9, 3), F.mse_loss)
        with pytest.raises(ValueError, match=r"disagree on the batch size"):
            engine.train_batch((torch.randn(8, 6), torch.randn(7, 6)), torch.randn(8, 3), F.mse_loss)
        # the engine is still usable
        engine.train_batch(*batch(8), F.mse_loss)
    finally:
        engine.close()


def test_fewer_microbatches_than_workers_is_refused():
    with pytest.raises(ValueError, match=r"num_microbatches=2 per round is fewer than the 3 workers"):
        engine_for(mlp(), 3, microbatches_per_round=2)


def test_host_weights_are_views_of_the_store():
    model = mlp()
    engine = engine_for(model, 1)
    try:
        group = engine.store.groups[0]
        assert model[0].weight.untyped_storage().data_ptr() == group.data.untyped_storage().data_ptr()
        with torch.no_grad():
            model[0].weight.fill_(0.5)  # what an optimizer step does
        assert (group.data[: model[0].weight.numel()] == 0.5).all()
    finally:
        engine.close()


def test_engine_runs_each_slot_on_the_round_robin_worker_across_rounds_and_steps(monkeypatch):
    """Which worker thread really ran each slot, over 3 batches of 2 rounds on 3 workers."""
    import threading

    from lightning_roundpipe.runtime import executor as executor_module

    ran: list[tuple[int, int, int, str]] = []  # (batch, round, slot, thread)
    original = executor_module.StageExecutor._run

    def recording(self, action, flight):
        if action.op.is_compute and action.microbatch % 3 == 0:
            ran.append((flight.call, action.round, action.slot, threading.current_thread().name))
        return original(self, action, flight)

    monkeypatch.setattr(executor_module.StageExecutor, "_run", recording)
    model = mlp()  # 9 layers; plan "4,4|1,4,4": 5 slots per round
    engine = engine_for(model, 3, microbatches_per_round=3, num_rounds=2, plan=StagePlan.parse("4,4|1,4,4"))
    try:
        for s in range(3):
            engine.train_batch(*batch(12, seed=s), F.mse_loss)
    finally:
        engine.close()
    workers = {(b, r, s): int(name.rsplit("-", 1)[1]) for b, r, s, name in ran}
    # slot i of round r of batch b: worker (g0_b + 5r + i) mod 3 with g0 = 0, 1, 2 (10 slots per batch)
    expected = {
        0: [[0, 1, 2, 0, 1], [2, 0, 1, 2, 0]],
        1: [[1, 2, 0, 1, 2], [0, 1, 2, 0, 1]],
        2: [[2, 0, 1, 2, 0], [1, 2, 0, 1, 2]],
    }
    for b, rounds in expected.items():
        for r, slots in enumerate(rounds):
            assert [workers[(b, r, s)] for s in range(5)] == slots, f"batch {b} round {r}"
    assert engine.dispatch_position == 0  # 3 batches x 10 slots = 30 = 0 mod 3


def test_gradient_dtype_conversion_in_small_chunks_gives_the_same_result(monkeypatch):
    """bf16 device gradients go into the fp32 host buffer in bounded chunks; chunk size must not matter."""
    from lightning_roundpipe.runtime.unloads import GradientUnloads

    results = []
    for chunk in (1 << 24, 7):
        monkeypatch.setattr(GradientUnloads, "_CONVERT_CHUNK", chunk)
        model = mlp()
        engine = engine_for(
            model, 2, microbatches_per_round=2, compute_dtype=torch.bfloat16, autocast_dtype=torch.bfloat16
        )
        try:
            engine.train_batch(*batch(8), F.mse_loss)
            results.append(engine_grads(engine))
        finally:
            engine.close()
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("chunk", [1 << 24, 5])
def test_tail_gradients_summed_on_the_device_equal_the_collectors_sums(monkeypatch, workers, chunk):
    """A settling batch's last gradient slot adds its later writes on the device (the host partial sum
    goes up, the sum comes down): bit-identical to the collector's host add, over tied weights, rounds,
    accumulation over batches and bf16 device gradients, and equal to plain autograd."""
    from lightning_roundpipe.runtime.executor import StageExecutor
    from lightning_roundpipe.runtime.unloads import GradientUnloads

    monkeypatch.setattr(GradientUnloads, "_CONVERT_CHUNK", chunk)
    summed = []
    original = GradientUnloads._add_on_device

    def spy(self, source, host, start, stop):
        summed.append(stop - start)
        original(self, source, host, start, stop)

    monkeypatch.setattr(GradientUnloads, "_add_on_device", spy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    model[4].weight = nn.Parameter(model[0].weight[:3].clone())
    model[2].weight = model[0].weight  # the tied weight's second write lands in the last backward slot
    reference = copy.deepcopy(model)
    batches = [batch(12, seed) for seed in (1, 2)]
    results = {}
    for on_device in (False, True):
        monkeypatch.setattr(StageExecutor, "add_tail_on_device", on_device)
        summed.clear()
        for dtype in (torch.float32, torch.bfloat16):
            engine = engine_for(
                copy.deepcopy(model), workers, microbatches_per_round=2, num_rounds=2,
                plan=StagePlan.parse("2,1|2,1,1,1"), compute_dtype=dtype,
                autocast_dtype=dtype if dtype is torch.bfloat16 else None,
            )  # fmt: skip
            try:
                for x, y in batches:  # the second batch's writes all add to the first's
                    engine.train_batch(x, y, F.mse_loss)
                results[on_device, dtype] = engine_grads(engine)
            finally:
                engine.close()
        assert bool(summed) == on_device, "the device path was not taken (or taken while off)"
    for dtype in (torch.float32, torch.bfloat16):
        for a, b in zip(results[False, dtype], results[True, dtype]):
            assert torch.equal(a, b)
    reference.zero_grad(set_to_none=True)
    for x, y in batches:
        F.mse_loss(reference(x), y).backward()
    assert_close(results[True, torch.float32], [p.grad for p in reference.parameters()])


def test_tail_slot_is_the_last_gradient_unload_with_no_compute_after_it():
    from lightning_roundpipe.runtime.unloads import tail_slot
    from lightning_roundpipe.schedule.dispatch import round_robin
    from lightning_roundpipe.schedule.transfers import add_transfers

    plan = StagePlan.parse("2,1|2,1,1,1")  # slots 0-1 forward, 2 fused, 3-5 backward
    with_grads = lambda slot: slot >= 2  # noqa: E731
    (one,) = add_transfers(round_robin(plan, 1, 2, 1, 0), "priority").workers
    assert tail_slot(one, with_grads) == (0, 5)
    # slot 5 frozen: slot 4's unload starts before slot 5's backward computes, so no slot is free of compute
    assert tail_slot(one, lambda slot: 2 <= slot <= 4) is None
    five = add_transfers(round_robin(plan, 5, 5, 3, 0), "priority").workers
    tails = [tail_slot(actions, with_grads) for actions in five]
    # worker 3 ends on a forward stage of round 2, interleaved with the unload of round 1's fused slot
    assert tails == [(2, 3), (2, 4), (2, 5), None, (2, 2)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("workers", "mbs", "rounds"), [(1, 1, 12), (2, 2, 6)])
def test_a_settling_batch_stages_gradients_no_faster_than_the_host_adds_them(monkeypatch, workers, mbs, rounds):
    """Many one-micro-batch rounds write each gradient many times; when the host adds fall behind, the
    staged copies waiting for them stay under twice the largest slot's gradients (without the bound: every
    round's copy at once), and the sums stay plain autograd's."""
    import threading
    import time

    from lightning_roundpipe.runtime.collector import GradCollector
    from lightning_roundpipe.runtime.host_pool import HostPool

    lock, held, peak, staged = threading.Lock(), [0], [0], {}
    submit, give = GradCollector.submit, HostPool.give

    def counted_submit(self, job):
        with lock:
            for t in job.staging.values():
                staged[id(t)] = t.nbytes
                held[0] += t.nbytes
            peak[0] = max(peak[0], held[0])
        submit(self, job)

    def counted_give(self, buffer, events=()):
        with lock:
            held[0] -= staged.pop(id(buffer), 0)
        give(self, buffer, events)

    def slow_adds(self, event):  # the collector's wait for each copy: host adds slower than the device
        if "collect" in threading.current_thread().name:
            time.sleep(0.01)

    monkeypatch.setattr(GradCollector, "submit", counted_submit)
    monkeypatch.setattr(HostPool, "give", counted_give)
    monkeypatch.setattr(WorkerDevice, "host_wait", slow_adds)
    model = mlp()
    reference = copy.deepcopy(model)
    x, y = batch(12)
    plan = StagePlan.parse("1,1,1,1,1,1,1,1|1,1,1,1,1,1,1,1,1")
    engine = engine_for(model, workers, plan=plan, microbatches_per_round=mbs, num_rounds=rounds)
    try:
        engine.train_batch(x, y, F.mse_loss)
        _, want = plain_grads(reference, x, y)
        assert_close(engine_grads(engine), want)
        largest = max(sum(engine.store.groups[g].compute.nbytes for g in engine.store.groups_of([i])) for i in range(9))
        assert peak[0] > 0 and peak[0] <= workers * 2 * largest  # a bound per worker's collector
    finally:
        engine.close()
