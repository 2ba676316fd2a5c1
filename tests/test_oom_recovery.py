"""A device running out of memory in a guarded batch: the batch runs again on a smaller plan and training
continues exactly (weights and gradients as without the fault, to the rounding of another micro-batching);
where it cannot be exact, a clear error and no hang."""

from __future__ import annotations

import copy
import threading
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import BoringPipeline, fit, flat_weights, next_batch_and_plain_gradients, relative_error
from test_async import make_optimizer, staleness_one_reference
from torch import nn

from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.engine import PipelineEngine
from lightning_roundpipe.engine.recovery import GUARDED_BATCHES, MAX_ATTEMPTS
from lightning_roundpipe.runtime import WorkerDevice
from lightning_roundpipe.runtime.flight import HostWrites
from lightning_roundpipe.runtime.updates import UpdateSpec


class Fault:
    """Raises ``torch.OutOfMemoryError`` in a layer's forward (no autograd), recompute, either of them
    (``"run"``) or backward, ``times`` times once armed. Shared by every replica of the layer (workers run
    deep copies; the key is a plain string)."""

    registry: dict[str, Fault] = {}

    def __init__(self, key: str, where: str, times: int = 1) -> None:
        self.where, self.left, self.fired = where, 0, 0
        self.times = times
        self._lock = threading.Lock()
        Fault.registry[key] = self

    def arm(self) -> None:
        self.left = self.times

    def fire(self, where: str) -> None:
        with self._lock:
            if self.where not in (where, "run" if where != "backward" else "") or self.left == 0:
                return
            self.left -= 1
            self.fired += 1
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB (injected in {where})")


class FaultLayer(nn.Module):
    """A linear layer that the fault registered under ``key`` can make run out of memory."""

    def __init__(self, width: int, key: str) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.key = key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fault = Fault.registry[self.key]
        fault.fire("recompute" if torch.is_grad_enabled() else "forward")
        y = self.linear(x)
        return _Backward.apply(y, self.key) if torch.is_grad_enabled() else y


class _Backward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, key: str) -> torch.Tensor:
        ctx.key = key
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        Fault.registry[ctx.key].fire("backward")
        return grad, None


def model(key: str, where: str, times: int = 1) -> tuple[nn.Sequential, Fault]:
    """Six layers, the fault in layer 3 (a backward stage's under most plans)."""
    fault = Fault(key, where, times)
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.Tanh(), FaultLayer(16, key), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 4)]
    return nn.Sequential(*layers), fault


def engine_of(seq: nn.Sequential, workers: int, asynchronous: bool = False, **kwargs: Any) -> PipelineEngine:
    return PipelineEngine(
        list(seq.children()), [WorkerDevice("cpu", i) for i in range(workers)], plan="auto", profile_steps=1,
        asynchronous=asynchronous, seed=0, **kwargs,
    )  # fmt: skip


def batches(n: int, size: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 8, generator=g), torch.randn(size, 4, generator=g)) for _ in range(n)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("where", ["run", "backward"])
def test_a_batch_that_runs_out_of_memory_runs_again_and_its_gradients_are_exact(workers, where):
    seq, fault = model(f"sync-{workers}-{where}", where)
    reference = copy.deepcopy(seq)
    engine = engine_of(seq, workers)
    data = batches(4)
    try:
        for i, (x, y) in enumerate(data):
            if i == 2:
                fault.arm()
                with pytest.warns(UserWarning, match=r"batch 2 ran out of memory on cpu in stage \d+ .* runs again"):
                    got, want = next_batch_and_plain_gradients(engine, reference, x, y)
                assert fault.fired == 1 and engine.recovery.recovered == 1
            else:
                got, want = next_batch_and_plain_gradients(engine, reference, x, y)
            assert relative_error(got, want) < 1e-5, i
            engine.store.clear_grads()
    finally:
        engine.close()


@pytest.mark.timeout(60)
def test_gradients_accumulated_before_the_failed_batch_are_kept():
    """Two batches per step: the second fails after its deep layers' gradients were added to the first
    batch's; the retry adds only the rest, so the sum is exactly the two batches' (no group twice)."""
    seq, fault = model("accumulate", "backward")
    reference = copy.deepcopy(seq)
    engine = engine_of(seq, 2)
    (x0, y0), (x1, y1), (x2, y2) = batches(3)
    try:
        engine.train_batch(x0, y0, F.mse_loss)  # measures the layers (one per stage)
        engine.store.clear_grads()
        engine.train_batch(x1, y1, F.mse_loss, grad_scale=0.5)
        fault.arm()
        with pytest.warns(UserWarning, match="runs again"):
            engine.train_batch(x2, y2, F.mse_loss, grad_scale=0.5)
        engine.store.install_grads()
        got = torch.cat([p.grad.flatten() for p in engine.store.parameters])
        reference.zero_grad()
        (0.5 * F.mse_loss(reference(x1), y1) + 0.5 * F.mse_loss(reference(x2), y2)).backward()
        want = torch.cat([p.grad.flatten() for p in reference.parameters()])
        assert relative_error(got, want) < 1e-5
    finally:
        engine.close()


@pytest.mark.timeout(60)
def test_a_batch_that_keeps_running_out_of_memory_raises_and_leaves_the_engine_usable():
    seq, fault = model("always", "backward", times=100)
    reference = copy.deepcopy(seq)
    engine = engine_of(seq, 2)
    (x0, y0), (x1, y1), (x2, y2) = batches(3)
    try:
        engine.train_batch(x0, y0, F.mse_loss)
        engine.store.clear_grads()
        fault.arm()
        with warnings.catch_warnings(record=True), pytest.raises(torch.OutOfMemoryError) as info:
            engine.train_batch(x1, y1, F.mse_loss)
        text = "\n".join(getattr(info.value, "__notes__", []))
        assert "gave up" in text and "gpu_memory" in text
        assert fault.fired <= MAX_ATTEMPTS
        fault.left = 0
        got, want = next_batch_and_plain_gradients(engine, reference, x2, y2)
        assert relative_error(got, want) < 1e-5
    finally:
        engine.close()


@pytest.mark.timeout(60)
def test_with_the_states_on_the_device_giving_up_says_the_host_would_leave_the_plan_more():
    """optimizer_on='auto' puts the states on a GPU where they take at most half of its limit: a batch that no
    smaller plan can hold must say so, and that optimizer_on='host' gives the plan the whole limit."""
    seq, fault = model("resident-gives-up", "backward", times=100)
    engine = engine_of(seq, 1, asynchronous=True, optimizer_on="device")
    opt = make_optimizer(seq.parameters())
    (x0, y0), (x1, y1) = batches(2)
    try:
        engine.train_batch(x0, y0, F.mse_loss, last_of_step=True)
        engine.submit_step(UpdateSpec.capture(opt))
        fault.arm()
        with warnings.catch_warnings(record=True), pytest.raises(torch.OutOfMemoryError) as info:
            engine.train_batch(x1, y1, F.mse_loss, last_of_step=True)
    finally:
        fault.left = 0
        engine.close()
    notes = "\n".join(info.value.__notes__)
    assert "gave up" in notes and "optimizer_on='host'" in notes and "GiB of this device" in notes


@pytest.mark.timeout(60)
def test_the_lowered_memory_limit_and_the_new_plan_travel_in_checkpoints():
    seq, fault = model("checkpoint", "run")
    engine = engine_of(seq, 1)
    (x0, y0), (x1, y1) = batches(2)
    try:
        engine.train_batch(x0, y0, F.mse_loss)
        fault.arm()
        with pytest.warns(UserWarning, match="memory limit"):  # a smaller stage or micro-batch fits: planned again
            engine.train_batch(x1, y1, F.mse_loss)
        state = engine.state_dict()
        assert state["memory_limit"] == engine.planner.memory_limit is not None
    finally:
        engine.close()
    resumed = engine_of(copy.deepcopy(seq), 1)
    try:
        resumed.load_state_dict(state)
        assert resumed.planner.memory_limit == state["memory_limit"]
        assert str(resumed.plan) == state["plan"]
        assert resumed.planner.microbatches_per_round == state["microbatches_per_round"]
    finally:
        resumed.close()


def test_host_writes_count_what_landed_and_say_when_another_attempt_cannot_be_exact():
    writes = HostWrites(skip=frozenset({9}))
    assert writes.planned((0, 1), (3, 9)) == (3,)  # 9 is on the host from an earlier attempt
    writes.planned((0, 2), (4,))
    writes.planned((1, 1), (3,))  # a second round writes group 3 again
    writes.slot_landed((0, 2))
    assert writes.complete(rounds=2) == ({4}, None)
    writes.slot_landed((0, 1))
    landed, why = writes.complete(rounds=2)
    assert landed == set() and "groups [3] had some but not all of their 2 rounds" in why
    writes.slot_landed((1, 1))
    writes.summing[(1, 2)] = (4,)
    landed, why = writes.complete(rounds=2)
    assert "groups [4] were being summed" in why


@pytest.mark.timeout(60)
def test_a_batch_that_cannot_run_again_exactly_fails_and_the_next_one_is_exact(monkeypatch):
    seq, fault = model("inexact", "backward")
    reference = copy.deepcopy(seq)
    engine = engine_of(seq, 2)
    (x0, y0), (x1, y1), (x2, y2) = batches(3)
    monkeypatch.setattr(HostWrites, "complete", lambda self, rounds: (set(), "a reason"))
    try:
        engine.train_batch(x0, y0, F.mse_loss)
        engine.store.clear_grads()
        fault.arm()
        with pytest.raises(torch.OutOfMemoryError) as info:
            engine.train_batch(x1, y1, F.mse_loss)
        assert "could not put the engine back as before this batch: a reason" in "\n".join(info.value.__notes__)
        got, want = next_batch_and_plain_gradients(engine, reference, x2, y2)
        assert relative_error(got, want) < 1e-5
    finally:
        engine.close()


@pytest.mark.timeout(60)
def test_giving_up_after_gradients_were_added_to_earlier_batches_drops_the_step_and_says_so(monkeypatch):
    """Whether a write landed before the failure depends on timing: this pins the case where one did."""
    seq, fault = model("stuck", "backward", times=100)
    monkeypatch.setattr(HostWrites, "complete", lambda self, rounds: ({0}, None))
    reference = copy.deepcopy(seq)
    engine = engine_of(seq, 2)
    (x0, y0), (x1, y1), (x2, y2), (x3, y3) = batches(4)
    try:
        engine.train_batch(x0, y0, F.mse_loss)
        engine.store.clear_grads()
        engine.train_batch(x1, y1, F.mse_loss, grad_scale=0.5)
        fault.arm()
        with warnings.catch_warnings(record=True), pytest.raises(torch.OutOfMemoryError) as info:
            engine.train_batch(x2, y2, F.mse_loss, grad_scale=0.5)
        notes = "\n".join(info.value.__notes__)
        assert "gave up" in notes
        assert (
            "were added to earlier batches' gradients" in notes and "this optimizer step so far were dropped" in notes
        )
        fault.left = 0
        got, want = next_batch_and_plain_gradients(engine, reference, x3, y3)
        assert relative_error(got, want) < 1e-5
    finally:
        engine.close()


class FaultyPipeline(BoringPipeline):
    """The boring module with a layer that runs out of memory at a chosen training batch."""

    def __init__(self, key: str, where: str, at: int | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fault = Fault(key, where)
        layers = list(self.model.children())
        layers.insert(3, FaultLayer(16, key))
        self.model = nn.Sequential(*layers)
        self.at = at

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.at:
            self.fault.arm()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("async_optimizer", [True, False])
def test_training_through_lightning_continues_as_without_the_fault(async_optimizer):
    """Through ``Trainer`` with the defaults (asynchronous optimizer, plan="auto"): the first batch on the
    automatic plan runs out of memory; the weights after the run equal a run without the fault."""
    kwargs = dict(max_epochs=1, accelerator="cpu", devices=2, gradient_clip_val=0.5)

    def run(at: int | None) -> tuple[torch.Tensor, int]:
        strategy = RoundPipeStrategy(profile_steps=2, async_optimizer=async_optimizer)
        key = f"fit-{async_optimizer}-{at}"
        module = fit(lambda: FaultyPipeline(key, "backward", at), {**kwargs, "strategy": strategy})
        return flat_weights(module), module.fault.fired

    clean, _ = run(None)
    with pytest.warns(UserWarning, match="ran out of memory"):
        faulted, fired = run(2)  # the first batch after the two measuring ones
    assert fired == 1
    assert relative_error(faulted, clean) < 1e-5


@pytest.mark.timeout(120)
def test_an_unguarded_asynchronous_batch_that_runs_out_of_memory_stops_with_the_advice():
    """Asynchronous batches after the guarded ones overlap the next batch and the previous update's casts:
    out of memory there stops the run (no hang) with what to change."""
    strategy = RoundPipeStrategy(profile_steps=1)
    at = 1 + GUARDED_BATCHES + 2  # past the measuring batch and the guarded first batches of the plan
    with pytest.raises(torch.OutOfMemoryError) as info:
        fit(lambda: FaultyPipeline("late", "backward", at), {"accelerator": "cpu", "devices": 2, "strategy": strategy})
    assert "gpu_memory" in "\n".join(info.value.__notes__)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("workers", "per_step", "place"),
    [(1, 1, "host"), (2, 1, "host"), (2, 2, "host"), (1, 1, "device"), (1, 2, "device")],
)
def test_asynchronous_training_equals_the_staleness_one_reference_after_a_recovered_batch(workers, per_step, place):
    """The first batch on the automatic plan fails (guarded: it settles, joins its step only when done, and
    no cast of the previous update lands before); the run still equals the explicit staleness-1 loop, with the
    optimizer's states on the host or on the device (where the failed attempt's gradients went)."""
    seq, fault = model(f"async-{workers}-{per_step}-{place}", "backward")
    reference = copy.deepcopy(seq)
    data = [batches(per_step) for _ in range(5)]
    engine = engine_of(seq, workers, asynchronous=True, optimizer_on=place)
    opt = make_optimizer(seq.parameters())
    try:
        for t, step_batches in enumerate(data):
            for i, (x, y) in enumerate(step_batches):
                if t * per_step + i == 1:  # batch 0 measures the layers; the plan starts at batch 1
                    fault.arm()
                engine.train_batch(x, y, F.mse_loss, grad_scale=1.0 / per_step, last_of_step=i == per_step - 1)
            engine.submit_step(UpdateSpec.capture(opt))
        engine.flush()
        assert fault.fired == 1 and engine.recovery.recovered == 1
    finally:
        engine.close()
    got = torch.cat([p.detach().flatten() for p in seq.parameters()])
    assert relative_error(got, staleness_one_reference(reference, data)) < 1e-5


@pytest.mark.timeout(60)
def test_the_first_batches_on_a_plan_and_longer_inputs_run_guarded_the_others_overlap():
    """Asynchronous mode: the measuring batch, the first batches on the plan and a batch whose
    micro-batches hold more input elements than any before on it (a longer sequence) are guarded."""
    seq, _ = model("sizes", "never")
    engine = engine_of(seq, 1, asynchronous=True)
    opt = make_optimizer(seq.parameters())
    seen: list[bool] = []
    guards = engine.launcher.guards
    engine.launcher.guards = lambda call, size: seen.append(guards(call, size)) or seen[-1]
    try:
        for i in range(6):
            x = torch.randn(24 if i == 4 else 12, 8)
            engine.train_batch(x, torch.randn(x.shape[0], 4), F.mse_loss, last_of_step=True)
            engine.submit_step(UpdateSpec.capture(opt))
        engine.flush()
    finally:
        engine.close()
    assert seen == [True] + [True] * GUARDED_BATCHES + [False, True, False]
