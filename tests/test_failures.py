"""A failing worker: the original exception reaches the main thread quickly, nothing hangs, and the
engine (or a new fit) works again afterwards."""

from __future__ import annotations

import copy
import threading
import time
import traceback
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import next_batch_and_plain_gradients
from torch import nn

from lightning_roundpipe.engine import PipelineEngine
from lightning_roundpipe.runtime import WorkerDevice
from lightning_roundpipe.runtime.host_pool import HostMemoryError, HostPool
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


class FaultyDevice(WorkerDevice):
    """A CPU worker whose copies in one direction (or whose gradient collector) fail once armed."""

    def __init__(self, index: int, site: str, armed: threading.Event) -> None:
        super().__init__("cpu", index)
        self.act_up, self.act_down, self.param_up, self.grad_down = "act_up", "act_down", "param_up", "grad_down"
        self.site, self.armed = site, armed

    def _maybe_fail(self, site: str) -> None:
        if self.armed.is_set() and site == self.site:
            raise Boom(f"injected {site} failure")

    def copy_up(self, dst, src, stream):
        self._maybe_fail(stream)
        super().copy_up(dst, src, stream)

    def copy_down(self, dst, src, stream):
        self._maybe_fail(stream)
        super().copy_down(dst, src, stream)

    def host_wait(self, event):
        if threading.current_thread().name.startswith("roundpipe-collector"):
            self._maybe_fail("collector")
        super().host_wait(event)


SITES = ["act_up", "param_up", "act_down", "grad_down", "collector"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("site", SITES)
def test_copy_and_collector_failures_reach_the_main_thread_and_stop_every_thread(site, asynchronous):
    from lightning_roundpipe.runtime.updates import UpdateSpec

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    armed = threading.Event()
    engine = PipelineEngine(
        list(model.children()), [FaultyDevice(i, site, armed) for i in range(2)], plan=StagePlan.parse("2|3,1,1"),
        microbatches_per_round=2, num_rounds=2, asynchronous=asynchronous,
    )  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randn(8, 2)

    def step() -> None:
        engine.train_batch(x, y, F.mse_loss)
        if asynchronous:
            engine.submit_step(UpdateSpec.capture(opt))
        else:
            engine.store.clear_grads()

    try:
        step()
        step()  # the second step's gradients are added to the first's: the collector has work
        armed.set()
        start = time.monotonic()
        with pytest.raises(Boom, match=f"injected {site} failure"):
            for _ in range(3):
                step()
            engine.flush()
        assert time.monotonic() - start < 10
        armed.clear()
        if not asynchronous:  # the synchronous engine recovers and trains on
            step()
    finally:
        engine.close()
    deadline = time.monotonic() + 5
    while [t for t in threading.enumerate() if t.name.startswith("roundpipe")] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("roundpipe")]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("async_optimizer", [False, True])
def test_keyboard_interrupt_stops_fit_and_on_exception_can_still_save(tmp_path, async_optimizer):
    import signal

    import lightning as L
    from helpers import BoringPipeline, boring_data

    from lightning_roundpipe import RoundPipeStrategy

    class Interrupt(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 3:
                raise KeyboardInterrupt

        def on_exception(self, trainer, pl_module, exception):
            trainer.save_checkpoint(tmp_path / "interrupted.ckpt")

    handler = signal.getsignal(signal.SIGINT)
    trainer = L.Trainer(
        strategy=RoundPipeStrategy(num_microbatches=3, async_optimizer=async_optimizer), accelerator="cpu",
        devices=2, max_epochs=1, logger=False, enable_progress_bar=False, enable_checkpointing=False,
        callbacks=[Interrupt()],
    )  # fmt: skip
    try:
        with pytest.raises(SystemExit):  # Lightning's graceful shutdown after Ctrl+C ends with exit(1)
            trainer.fit(BoringPipeline(), boring_data())
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores further Ctrl+C during its shutdown
    assert trainer.interrupted
    saved = torch.load(tmp_path / "interrupted.ckpt", weights_only=False)
    assert saved["global_step"] == 3 and saved["roundpipe"]["step"] == (3 if async_optimizer else 0)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("roundpipe")]


@pytest.mark.timeout(60)
def test_a_failing_checkpoint_write_stops_fit_and_keeps_the_previous_file(tmp_path, monkeypatch):
    import lightning as L
    from helpers import BoringPipeline, boring_data

    from lightning_roundpipe import RoundPipeStrategy

    def fit(epochs: int) -> None:
        checkpoint = L.pytorch.callbacks.ModelCheckpoint(
            dirpath=tmp_path, filename="model", enable_version_counter=False
        )
        trainer = L.Trainer(
            strategy=RoundPipeStrategy(num_microbatches=3), accelerator="cpu", devices=2, max_epochs=epochs,
            logger=False, enable_progress_bar=False, callbacks=[checkpoint],
        )  # fmt: skip
        trainer.fit(BoringPipeline(), boring_data())

    fit(1)
    before = torch.load(tmp_path / "model.ckpt", weights_only=False)["state_dict"]

    def disk_full(obj, f, *args, **kwargs):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        fit(1)
    monkeypatch.undo()
    after = torch.load(tmp_path / "model.ckpt", weights_only=False)["state_dict"]
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt"]
    assert not [t.name for t in threading.enumerate() if t.name.startswith("roundpipe")]


@pytest.mark.timeout(30)
def test_out_of_memory_in_a_stage_names_the_stage_and_what_to_change():
    class Greedy(nn.Module):
        def forward(self, x):
            if torch.is_grad_enabled():  # the recompute of the backward stage, as a long sequence would
                raise torch.OutOfMemoryError("Tried to allocate 384.00 MiB")
            return x

    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), Greedy(), nn.Linear(4, 4))
    engine = PipelineEngine(list(model.children()), [WorkerDevice("cpu", i) for i in range(2)], plan="2,1|1,1,2")
    try:
        with pytest.raises(torch.OutOfMemoryError) as info:
            engine.train_batch(torch.randn(6, 4), torch.randn(6, 4), F.mse_loss)
    finally:
        engine.close()
    note = "\n".join(getattr(info.value, "__notes__", []))
    assert "stage 3 (backward, layers 2-2) ran out of memory" in note
    assert "gpu_memory" in note and "num_microbatches" in note


@pytest.mark.timeout(30)
def test_host_memory_running_out_is_a_clear_error_and_the_engine_goes_on(monkeypatch):
    """A buffer for activations in transit that the machine cannot hold raises ``HostMemoryError`` on the
    worker that asked for it (downloading a stage's output; with CUDA the main thread's pinned copies of
    the inputs ask the same pool); it reaches the caller with what to change, and the next batch, with
    memory back, is exact."""
    monkeypatch.setattr(HostPool, "check_every", 0)  # look at every buffer, however small
    model, _ = build("forward")
    reference = copy.deepcopy(model)
    engine = PipelineEngine(list(model.children()), [WorkerDevice("cpu", i) for i in range(2)], plan="3,1|2,2,2")
    out_of_memory = threading.Event()

    def available() -> int:
        asking = threading.current_thread().name
        return -1 if out_of_memory.is_set() and asking.startswith("roundpipe-worker") else 1 << 40

    engine.pool.available, engine.pool.reserve = available, 0
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    try:
        out_of_memory.set()
        start = time.monotonic()
        with pytest.raises(HostMemoryError, match="host memory") as info:
            engine.train_batch(x, y, F.mse_loss)
        assert time.monotonic() - start < 10
        assert "shorter sequences" in str(info.value) and "gradient accumulation" in str(info.value)
        out_of_memory.clear()
        engine.store.clear_grads()
        got, want = next_batch_and_plain_gradients(engine, reference, x, y)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-7)
    finally:
        engine.close()
    assert isinstance(info.value, MemoryError)  # what baselines.py's probes read as the host running out


@pytest.mark.timeout(30)
@pytest.mark.parametrize("plan", ["auto", "3,1|2,2,2"])
def test_host_memory_running_out_while_measuring_the_layers_says_a_plan_skips_it(monkeypatch, plan):
    """Under plan='auto' the first batches keep every layer's input on the host; running out there is
    the measurement's doing, and the error says how to do without it. A planned batch does not say so."""
    monkeypatch.setattr(HostPool, "check_every", 0)
    model, _ = build("forward")
    engine = PipelineEngine(list(model.children()), [WorkerDevice("cpu", i) for i in range(2)], plan=plan)
    engine.pool.reserve = 0
    engine.pool.available = lambda: -1 if threading.current_thread().name.startswith("roundpipe-worker") else 1 << 40
    try:
        with pytest.raises(HostMemoryError, match="host memory") as info:
            engine.train_batch(torch.randn(6, 4), torch.randn(6, 2), F.mse_loss)
    finally:
        engine.close()
    note = "\n".join(getattr(info.value, "__notes__", []))
    assert ("A plan passed to RoundPipeStrategy skips this measurement" in note) == (plan == "auto"), note


def test_host_pool_leaves_its_reserve_free_and_reads_the_memory_sparingly(monkeypatch):
    reads = []

    def available() -> int:
        reads.append(1)
        return 3 * 2**30

    pool = HostPool(pin=False, available=available, reserve=2 * 2**30)
    pool.take(1024, torch.float32)
    assert reads == []  # small buffers are counted, not checked one by one
    monkeypatch.setattr(HostPool, "check_every", 8 * 2**20)
    with pytest.raises(HostMemoryError, match=r"1\.25 GiB buffer .* leave 1\.75 GiB"):
        pool.take(5 * 2**28 // 4, torch.float32)  # 1.25 GiB: checked before anything is allocated
    assert len(reads) == 1
    for _ in range(3):
        pool.take(2**20, torch.float32)  # 4 MiB each: the second one crosses 8 MiB since the last look
    assert len(reads) == 2


class _FakeCudart:
    """Page-locking that does nothing: lets a CPU test run the pool's pinned path (free lists, reuse)."""

    def cudaHostRegister(self, ptr, nbytes, flags):
        return 0

    def cudaHostUnregister(self, ptr):
        return 0


@pytest.fixture
def pinned_pool(monkeypatch):
    """Engines built in the test stage their inputs through pinned-style pool buffers."""
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _FakeCudart())
    monkeypatch.setattr(HostPool, "check_every", 0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("thread", ["MainThread", "roundpipe-worker"])
def test_host_memory_running_out_leaks_no_buffer_and_the_next_batch_runs(pinned_pool, thread):
    """With page-locked buffers the main thread stages the inputs into the pool too. Running out there,
    or on a worker, must neither leave the next batch waiting on a half-built batch nor keep buffers
    out of the pool: after each failure every buffer the pool made is back in it."""
    model, _ = build("forward")
    reference = copy.deepcopy(model)
    engine = PipelineEngine(list(model.children()), [WorkerDevice("cpu", i) for i in range(2)], plan="3,1|2,2,2")
    engine.pool.pin = True
    engine.pool.idle_batches = 100  # the failed batches' buffers stay to be counted (none given back by age)
    out_of_memory = threading.Event()
    engine.pool.reserve = 0
    engine.pool.available = lambda: (
        -1 if out_of_memory.is_set() and threading.current_thread().name.startswith(thread) else 1 << 40
    )
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    try:
        engine.train_batch(x, y, F.mse_loss)  # the pool now holds a batch's worth of buffers
        engine.store.clear_grads()
        out_of_memory.set()
        for _ in range(3):  # a longer batch: buffers of new sizes, which the pool checks before it makes them
            with pytest.raises(HostMemoryError):
                engine.train_batch(torch.randn(12, 4), torch.randn(12, 2), F.mse_loss)
            assert engine.pool.free_bytes() == engine.pool.buffer_bytes > 0
        out_of_memory.clear()
        got, want = next_batch_and_plain_gradients(engine, reference, x, y)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-7)
        assert engine.pool.free_bytes() == engine.pool.buffer_bytes
    finally:
        engine.close()


def test_a_buffer_that_does_not_fit_first_gives_back_idle_buffers_of_other_sizes(pinned_pool):
    """Batches of changing shapes leave free buffers of sizes nobody asks for again; they are unpinned
    and dropped before the pool declares the host full."""
    pool = HostPool(pin=True, reserve=0)
    pool.available = lambda: (40 << 20) - pool.buffer_bytes  # the pinned buffers take the machine's memory
    old = pool.take(6 << 20, torch.uint8)
    pool.give(old)
    del old
    new = pool.take(36 << 20, torch.uint8)  # 6 + 36 MiB would not fit in 40: the idle 6 MiB go first
    assert new.numel() == 36 << 20 and pool.buffer_bytes == pool.pinned_bytes == 36 << 20
    assert pool.peak_buffer_bytes == 36 << 20  # the 6 MiB went before the 36 came: never both at once
    with pytest.raises(HostMemoryError, match="host memory"):
        pool.take(6 << 20, torch.uint8)  # nothing idle is left to give back
    pool.close()


def test_a_slightly_smaller_request_takes_an_idle_larger_buffer_and_buffers_idle_for_batches_go_back(pinned_pool):
    """Micro-batches of changing sizes: a request takes the start of an idle buffer up to 1.25 times its size
    rather than a new one, the whole buffer comes back when the view does, and what no batch asked for lately
    is given back."""
    pool = HostPool(pin=True, reserve=0)
    big = pool.take(1000, torch.float32)
    pool.give(big)
    smaller = pool.take(850, torch.float32)  # within 1.25x: the idle 1000's start
    assert smaller.numel() == 850 and smaller.data_ptr() == big.data_ptr() and pool.buffer_bytes == 4000
    pool.give(smaller)
    assert pool.free_bytes() == 4000 and pool.take(1000, torch.float32).data_ptr() == big.data_ptr()
    pool.give(big)
    other = pool.take(700, torch.float32)  # more than 1.25x smaller: a buffer of its own
    assert other.data_ptr() != big.data_ptr() and pool.buffer_bytes == 4000 + 2800
    pool.give(other)
    pool.tick()
    kept = pool.take(700, torch.float32)  # used in the batch after: it stays
    pool.give(kept)
    pool.tick()
    assert pool.buffer_bytes == 6800  # nothing idle for 2 batches yet
    pool.tick()  # the 1000 has been idle since before the last two batches began
    assert pool.buffer_bytes == pool.pinned_bytes == 2800 and pool.free_bytes() == 2800
    pool.close()


@pytest.mark.timeout(60)
def test_batches_of_changing_sizes_do_not_grow_the_pool_batch_after_batch(pinned_pool):
    """Every batch a new number of rows (new sizes at every boundary): the pool holds about a batch's buffers,
    not one set per size ever seen; training stays exact."""
    model, _ = build("forward")
    reference = copy.deepcopy(model)
    engine = PipelineEngine(list(model.children()), [WorkerDevice("cpu", i) for i in range(2)], plan="3,1|2,2,2")
    engine.pool.pin = True
    try:
        held = []
        for rows in range(32, 8, -1):
            x, y = torch.randn(rows, 4), torch.randn(rows, 2)
            got, want = next_batch_and_plain_gradients(engine, reference, x, y)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-7)
            engine.store.clear_grads()
            held.append(engine.pool.buffer_bytes)
        assert max(held[4:]) <= 2 * held[0]  # one set per size would have summed to about 17 times the first
    finally:
        engine.close()


def test_a_new_plan_gives_back_the_idle_buffers_of_the_old_one(pinned_pool, monkeypatch):
    """Measuring at two micro-batch sizes and then running a third leaves buffers of sizes the next batch
    never asks for: the second measuring batch and the switch unpin them at once instead of holding them
    until the host runs short."""
    trimmed = []
    trim = HostPool.trim_idle
    monkeypatch.setattr(HostPool, "trim_idle", lambda self: trimmed.append(trim(self)) or trimmed[-1])
    model, _ = build("forward")
    engine = PipelineEngine(list(model.children()), [WorkerDevice("cpu", i) for i in range(2)], plan="auto")
    engine.pool.pin = True
    try:
        held = []
        for _ in range(4):  # measuring at 4, then 8 micro-batches; then the chosen plan, twice
            engine.train_batch(torch.randn(8, 4), torch.randn(8, 2), F.mse_loss)
            engine.store.clear_grads()
            held.append(engine.pool.buffer_bytes)
        # between the two measuring sizes (the first one's buffers), and at the switch (the second one's)
        assert len(trimmed) == 2 and all(t > 0 for t in trimmed)
        assert held[1] < held[0] / 4  # after the second measuring batch: only its losses are still out
    finally:
        engine.close()


class _FailingLoss:
    """``BoringPipeline`` failing at batch ``at`` on a worker thread: in its loss, once the update submitted before
    finished its math, or (``where="backward"``) in its backward: at the loss's input, whose error reaches the main
    thread before Lightning counts the step, or (``counted``) in a layer of its own once the step was counted."""

    def __init__(self, at: int, where: str = "loss", counted: bool = False) -> None:
        self.at, self.where, self.rows, self.counted, self.engine = at, where, 0, counted, None
        """``counted``: the backward fails only once Lightning counted the batch's step (its update submitted)."""

    def module(self):
        from helpers import BackwardHook, BoringPipeline

        import lightning_roundpipe

        failing = self

        class Failing(BoringPipeline):
            def __init__(self):
                super().__init__()
                if failing.counted:  # (a layer's backward runs after train_batch returned, the loss's before)
                    self.model.insert(1, BackwardHook(failing.backward))

            def training_step(self, batch, batch_idx):
                x, y = batch
                engine = failing.engine = self.trainer.strategy.engine

                def loss(out, target):
                    if failing.where == "loss" and batch_idx == failing.at:
                        engine.crew.optimizer.wait_math()  # the update of the step before finished
                        raise RuntimeError("the loss failed")
                    return F.mse_loss(out if failing.counted else BackwardHook(failing.backward)(out), target)

                return lightning_roundpipe.pipeline_loss(self.model, x, y, loss)

        return Failing()

    def backward(self, grad: torch.Tensor) -> None:
        self.rows += grad.shape[0]
        if self.where == "backward" and self.rows > self.at * 12:  # (12 rows a batch)
            deadline = time.monotonic() + 5.0
            while self.counted and self.engine.steps.step <= self.at:
                assert time.monotonic() < deadline, "the step was never counted"
                time.sleep(0.005)
            raise RuntimeError("a backward failed")


def _checkpoints(tmp_path, failing: _FailingLoss | None):
    import lightning as L
    from helpers import boring_data
    from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

    from lightning_roundpipe import RoundPipeStrategy

    every = ModelCheckpoint(dirpath=tmp_path / "every", filename="{step}", every_n_train_steps=1, save_top_k=-1)
    # (a fixed plan: no batch settles before train_batch returns, so a backward can fail after its step's count)
    callbacks = [OnExceptionCheckpoint(dirpath=tmp_path, filename="failed")] if failing else [every]
    plan = "3,3|4,3,3" if failing and failing.counted else "3,2|4,2,3"  # (the gate as a layer of its own: 10)
    trainer = L.Trainer(
        strategy=RoundPipeStrategy(num_microbatches=3, plan=plan), accelerator="cpu", devices=2, max_epochs=1,
        logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )  # fmt: skip
    L.seed_everything(1, verbose=False)
    trainer.fit(failing.module() if failing else _FailingLoss(-1).module(), boring_data())


def _same_step(failed: dict, regular: dict) -> None:
    assert failed["global_step"] == regular["global_step"]
    for k, v in regular["state_dict"].items():
        assert torch.equal(failed["state_dict"][k], v), k
    for k, state in regular["optimizer_states"][0]["state"].items():
        got = failed["optimizer_states"][0]["state"][k]
        assert all(torch.equal(got[n], t) for n, t in state.items())
    assert "compute" not in failed["roundpipe"] and failed["roundpipe"]["step"] == regular["roundpipe"]["step"]


@pytest.mark.timeout(120)
def test_on_exception_checkpoint_after_a_worker_failure_holds_the_last_whole_step(tmp_path):
    """Lightning's ``OnExceptionCheckpoint`` after a failure on a worker thread: the asynchronous update of the step
    before finishes, and the checkpoint equals the regular one of that step (weights, optimizer states, counters),
    without the compute copies a pending update would need: a resumed run's next step reads the masters. Before,
    its save flushed the stopped engine and raised the error again, writing nothing."""
    _checkpoints(tmp_path, None)
    with pytest.raises(RuntimeError, match="the loss failed"):
        _checkpoints(tmp_path, _FailingLoss(at=5))
    failed = torch.load(tmp_path / "failed.ckpt", weights_only=False)
    _same_step(failed, torch.load(tmp_path / "every" / "step=5.ckpt", weights_only=False))
    import lightning as L
    from helpers import boring_data

    from lightning_roundpipe import RoundPipeStrategy

    trainer = L.Trainer(
        strategy=RoundPipeStrategy(num_microbatches=3, plan="3,2|4,2,3"), accelerator="cpu", devices=2, max_epochs=2,
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(_FailingLoss(-1).module(), boring_data(), ckpt_path=tmp_path / "failed.ckpt")  # resumed from it
    assert trainer.global_step == 16  # (3 more batches in the first epoch, then 8; Lightning warns its loader restarts)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("counted", [False, True])
def test_after_a_backward_failure_a_checkpoint_is_a_whole_step_or_none_with_a_warning(tmp_path, counted):
    """A failure in a batch's backward may come after Lightning counted its step, while that step's update cannot
    finish (its gradients are incomplete): then no checkpoint is written, with a warning, rather than one whose
    weights hold fewer steps than its step count. Where the error came before the count, the checkpoint is that
    step's."""
    _checkpoints(tmp_path, None)
    with pytest.raises(RuntimeError, match="a backward failed"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _checkpoints(tmp_path, _FailingLoss(at=6, where="backward", counted=counted))
    said = [w for w in caught if "no checkpoint written after the failure" in str(w.message)]
    if counted:
        assert len(said) == 1 and not (tmp_path / "failed.ckpt").exists()
    else:  # (the error reaches the main thread before the count)
        failed = torch.load(tmp_path / "failed.ckpt", weights_only=False)
        _same_step(failed, torch.load(tmp_path / "every" / f"step={failed['global_step']}.ckpt", weights_only=False))
        assert not said
