"""Where the weights' device buffers come from: the compute stream's pool, taken before the compute their upload
overlaps, and ordered after compute's earlier uses of the blocks (``runtime/uploads.py``)."""

from __future__ import annotations

import copy
import sys
import threading
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_roundpipe.engine import PipelineEngine
from lightning_roundpipe.runtime import WorkerDevice
from lightning_roundpipe.runtime import uploads as uploads_module
from lightning_roundpipe.runtime.slots import WorkerSlots
from lightning_roundpipe.schedule import StagePlan
from lightning_roundpipe.schedule.dispatch import round_robin
from lightning_roundpipe.schedule.transfers import add_transfers


def _caller() -> str:
    """The WeightUploads method that asked its ``_buffers`` for buffers (through ``_from_compute`` or not)."""
    frame = sys._getframe(2)
    return frame.f_back.f_code.co_name if frame.f_code.co_name == "_from_compute" else frame.f_code.co_name


@dataclass(frozen=True)
class Event:
    stream: str
    at: int

    def synchronize(self) -> None:  # (the CPU stand-in's work is done when issued)
        pass

    def query(self) -> bool:
        return True


class Streams(WorkerDevice):
    """A CPU worker with named streams that logs, in issue order, what it is asked to order and allocate."""

    def __init__(self, index: int) -> None:
        super().__init__("cpu", index)
        self.compute, self.act_up, self.act_down = "compute", "act_up", "act_down"
        self.param_up, self.grad_down = "param_up", "grad_down"
        self.log: list[tuple] = []
        self._lock = threading.Lock()

    def _note(self, *entry) -> int:
        with self._lock:
            self.log.append(entry)
            return len(self.log) - 1

    def on(self, stream):
        self._note("on", stream)
        return super().on(stream)

    def record(self, stream):
        with self._lock:
            event = Event(stream, len(self.log))
            self.log.append(("record", stream, event))
        return event

    def wait(self, stream, event):
        self._note("wait", stream, event)

    def empty(self, numel, dtype, stream):
        buffer = super().empty(numel, dtype, stream)
        self._note("empty", stream, buffer.data_ptr())
        return buffer

    def copy_up(self, dst, src, stream):
        self._note("copy_up", stream, dst.untyped_storage().data_ptr())
        super().copy_up(dst, src, stream)


def test_reservations_take_each_later_upload_before_the_run_it_overlaps():
    plan = StagePlan.parse("2,1|2,1,1,1")  # slots 0-1 forward, 2 fused, 3-5 backward
    (one,) = add_transfers(round_robin(plan, 1, 2, 1, 0), "priority").workers
    text = [str(a) for a in one]
    found = uploads_module.reservations(one)
    # each slot's run opens with its first micro-batch; the next slot's upload is taken there; W0 precedes all compute
    assert {text[i]: [str(a) for a in loads] for i, loads in found.items()} == {
        f"0:{op}{s}.0": [f"0:W{s + 1}~0/2"] for op, s in zip("FFLBB", range(5))
    }
    two = add_transfers(round_robin(plan, 2, 2, 2, 0), "priority").workers
    for actions in two:
        found = uploads_module.reservations(actions)
        loads = [(a.round, a.slot) for a in actions if a.op.name == "LOAD" and a.is_first_part]
        assert [(a.round, a.slot) for ls in found.values() for a in ls] == loads[1:]  # all but the list's first
        for i, (later,) in found.items():
            assert actions[i].op.is_compute and actions[i].microbatch % 2 == 0  # a run's first micro-batch
            assert actions.index(later) > i


def test_the_slot_taken_ahead_is_the_one_each_worker_uploads_first_in_the_next_batch():
    from lightning_roundpipe.schedule.build import batch_schedule

    for plan in ("|1", "1|2,1", "2,1|2,2,1"):
        for workers in range(1, 6):
            for rounds in (1, 2, 3):
                stages = StagePlan.parse(plan)
                now = batch_schedule(stages, workers, workers, rounds, workers - 1, "priority")
                after = batch_schedule(stages, workers, workers, rounds, now.next_first_worker, "priority")
                for w, actions in enumerate(after.workers):
                    first = next((a.slot for a in actions if a.op.name == "LOAD"), None)
                    assert uploads_module.next_first_slot(w, now) == first, (plan, workers, rounds, w)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("from_compute", "ahead"), [(True, True), (True, False), (False, False)])
def test_uploads_write_compute_pool_buffers_only_after_computes_earlier_uses(monkeypatch, from_compute, ahead):
    monkeypatch.setattr(uploads_module.WeightUploads, "from_compute_pool", from_compute)
    monkeypatch.setattr(uploads_module.WeightUploads, "take_ahead", ahead)
    taken: list[tuple[int, str, str, Streams, int]] = []
    original = uploads_module.WeightUploads._buffers

    def spy(self, slot, flight, stream):
        caller = _caller()  # reserve(_ahead): before a run; _take: when the upload starts
        taken.append((slot, stream, caller, self.device, len(self.device.log)))
        return original(self, slot, flight, stream)

    monkeypatch.setattr(uploads_module.WeightUploads, "_buffers", spy)
    holding: list[int] = []
    reserve = uploads_module.WeightUploads.reserve

    def count(self, load, flight):  # before a run's next slot's buffers are taken, only the run's own are held
        holding.append(sum(1 for loaded in self.slots.loaded.values() if loaded.flats))
        reserve(self, load, flight)

    monkeypatch.setattr(uploads_module.WeightUploads, "reserve", count)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    plain = copy.deepcopy(model)
    devices = [Streams(i) for i in range(2)]
    engine = PipelineEngine(
        list(model.children()), devices, plan=StagePlan.parse("2,1|2,2,1"), microbatches_per_round=2, num_rounds=2,
        asynchronous=True,
    )  # fmt: skip
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    try:
        for _ in range(2):  # the second batch's gradients add to the first's
            engine.train_batch(x, y, F.mse_loss)
        engine.flush()
        engine.store.install_grads()
        got = [p.grad.clone() for p in engine.store.parameters]
    finally:
        engine.close()
    for _ in range(2):
        F.mse_loss(plain(x), y).backward()
    for a, p in zip(got, plain.parameters()):
        torch.testing.assert_close(a, p.grad)
    # 5 slots x 2 rounds over 2 workers, two batches: on, every buffer from compute's pool; a worker's first upload
    # of the second batch (slot 0 or 1) in buffers the first batch took ahead, those of the first batch at its start
    assert {stream for _, stream, *_ in taken} == {"compute" if from_compute else "param_up"}
    assert len(taken) == 20 + (2 if ahead else 0)  # four taken ahead, two of them used instead of new ones
    at_start = sorted(slot for slot, _, caller, *_ in taken if caller == "_take")
    assert at_start == ([0, 1] if ahead else [0, 0, 1, 1] if from_compute else sorted(list(range(5)) * 4))
    assert holding == ([1] * 16 if from_compute else [])  # (the slot before went back after its last compute)
    for _, stream, caller, dev, since in taken:
        if stream != "compute":
            continue
        log = dev.log
        at = next(i for i in range(since, len(log)) if log[i][:2] == ("empty", "compute"))
        copies = [i for i in range(at, len(log)) if log[i][:1] == ("copy_up",) and log[i][2] == log[at][2]]
        if not copies:  # the last batch's ahead buffers: no batch came for them
            continue
        # the event the upload waits for was recorded on compute right after the buffers were taken ...
        event = next(e[2] for e in log[at : copies[0]] if e[:2] == ("wait", "param_up") and e[2] is not None)
        assert event.stream == "compute" and event.at > at
        assert ("on", "compute") not in log[at : event.at]
        if caller != "_take":  # ... and before the compute the upload overlaps was issued: the prefetch is kept
            assert ("on", "compute") in log[event.at : copies[0]]


@pytest.mark.timeout(60)
def test_a_run_that_never_read_its_weights_orders_compute_after_their_upload_before_giving_them_back(monkeypatch):
    """A micro-batch with nothing to count skips its fused and backward compute: the run's buffers go back to
    compute's pool unread, so compute first waits for their upload, which may still be queued."""
    unread: list[tuple[Streams, Event | None, int]] = []
    release = WorkerSlots.release

    def spy(self, key):
        loaded = self.loaded[key]
        if loaded.flats and loaded.tensors is None:
            unread.append((self.device, loaded.ready, len(self.device.log)))
        release(self, key)

    monkeypatch.setattr(WorkerSlots, "release", spy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 5))
    plain = copy.deepcopy(model)
    tokens, labels = torch.randint(0, 5, (4, 3)), torch.randint(0, 5, (4, 3))
    labels[2:] = -100  # the second round's micro-batch has no counted token: its fused and backward runs skip

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)

    engine = PipelineEngine(
        list(model.children()), [Streams(0)], plan=StagePlan.parse("1,1|2,1,1"), microbatches_per_round=1,
        num_rounds=2,
    )  # fmt: skip
    try:
        engine.train_batch(tokens, labels, loss_fn, reduction=lambda t: (t != -100).sum())
        engine.store.install_grads()
        got = [p.grad.clone() for p in engine.store.parameters]
    finally:
        engine.close()
    loss_fn(plain(tokens), labels).backward()
    for a, p in zip(got, plain.parameters()):
        torch.testing.assert_close(a, p.grad)
    assert len(unread) == 3  # round 1's fused slot and its two backward slots
    for dev, ready, at in unread:
        assert ready is not None and ready.stream == "param_up"
        assert dev.log[at] == ("wait", "compute", ready)


def _two_batches(monkeypatch, fail, asynchronous=True) -> tuple[PipelineEngine, list[torch.Tensor], list[torch.Tensor]]:
    """Two batches on one worker whose ``_buffers`` raises ``torch.OutOfMemoryError`` where ``fail(slot, caller)``."""
    original = uploads_module.WeightUploads._buffers

    def buffers(self, slot, flight, stream):
        if fail(slot, _caller()):
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return original(self, slot, flight, stream)

    monkeypatch.setattr(uploads_module.WeightUploads, "_buffers", buffers)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    plain = copy.deepcopy(model)
    engine = PipelineEngine(
        list(model.children()), [Streams(0)], plan=StagePlan.parse("2,1|2,2,1"), asynchronous=asynchronous
    )
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    try:
        for _ in range(2):
            engine.train_batch(x, y, F.mse_loss)
            F.mse_loss(plain(x), y).backward()
        engine.flush()
    except BaseException:
        engine.close()
        raise
    engine.store.install_grads()
    return engine, [p.grad.clone() for p in engine.store.parameters], [p.grad for p in plain.parameters()]


@pytest.mark.timeout(60)
def test_running_out_of_memory_for_an_upload_taken_before_a_run_names_that_upload(monkeypatch):
    with pytest.raises(torch.OutOfMemoryError) as caught:
        _two_batches(monkeypatch, lambda slot, caller: slot == 3 and caller == "reserve")
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "running action 0:W3~0/" in notes  # not the run it was taken before (0:L2.0)
    assert "stage 3 (backward" in notes


@pytest.mark.timeout(60)
def test_buffers_taken_ahead_are_best_effort_and_given_back_at_close(monkeypatch):
    engine, got, want = _two_batches(monkeypatch, lambda slot, caller: caller == "reserve_ahead")
    try:
        for a, b in zip(got, want):  # the second batch took its first buffers when its upload started
            torch.testing.assert_close(a, b)
        assert all(e._uploads.ahead is None for e in engine.crew.executors)
    finally:
        engine.close()
    engine, _, _ = _two_batches(monkeypatch, lambda slot, caller: False)
    assert all(e._uploads.ahead is not None for e in engine.crew.executors)
    engine.close()
    assert all(e._uploads.ahead is None for e in engine.crew.executors)
    engine, _, _ = _two_batches(monkeypatch, lambda slot, caller: False, asynchronous=False)
    assert all(e._uploads.ahead is None for e in engine.crew.executors)  # batches that settle take none ahead
    engine.close()
