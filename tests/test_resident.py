"""``optimizer_on="device"``: the training states and updates on the worker's device, in the asynchronous optimizer's
exact order (staleness one), so the weights equal the host optimizer's; the host gets them back at every flush."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from helpers import BackwardHook
from test_async import batches, make_optimizer, mlp, run_async, staleness_one_reference

from lightning_roundpipe.engine import PipelineEngine
from lightning_roundpipe.runtime import WorkerDevice
from lightning_roundpipe.runtime.one_pass import OnePass
from lightning_roundpipe.runtime.updates import UpdateSpec
from lightning_roundpipe.schedule import StagePlan

PLAN = StagePlan.parse("2,2,1|2,1,2,2")
pytestmark = pytest.mark.filterwarnings("error:roundpipe.*changed on the host")  # only where a test edits


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("kwargs", "per_step"),
    [
        ({}, 1),
        ({"microbatches_per_round": 3, "num_rounds": 2, "plan": PLAN}, 1),
        ({"microbatches_per_round": 2}, 2),  # gradient accumulation over two batches
        ({"microbatches_per_round": 2, "plan": "auto", "profile_steps": 1, "last_of_step": True}, 2),
        ({"microbatches_per_round": 3, "num_rounds": 2, "plan": PLAN, "double_buffer": True}, 1),
    ],
)
@pytest.mark.parametrize("place", ["device", 0.5])  # every trainable group's states there, or the deepest half's
def test_weights_equal_the_host_optimizers_and_a_staleness_one_reference(monkeypatch, kwargs, per_step, place):
    model, data = mlp(), batches(5, per_step)
    want = staleness_one_reference(model, data)
    # double-buffered, the host's AdamW and cast would take one kernel of their own rounding: torch's here
    monkeypatch.setattr(OnePass, "enabled", False)
    host, _ = run_async(copy.deepcopy(model), data, 1, **kwargs)
    device, opt = run_async(copy.deepcopy(model), data, 1, optimizer_on=place, **kwargs)
    assert torch.equal(device, host)  # the same kernels in the same order on the CPU stand-in
    assert (device - want).norm() <= 1e-5 * want.norm()
    assert all(set(s) >= {"exp_avg", "exp_avg_sq", "step"} for s in opt.state.values())  # back on the host


@pytest.mark.timeout(60)
@pytest.mark.parametrize("place", ["host", "device"])
@pytest.mark.parametrize(("kind", "per_step"), [("own", 1), ("counted", 1), ("global-norm", 1), ("counted", 2)])
def test_optimizers_beyond_per_parameter_state_equal_the_reference(place, kind, per_step):
    """The optimizer thread steps a shadow of the user's optimizer, group by group. It must carry every attribute
    (bitsandbytes' 8-bit optimizers failed at the first update when it carried only torch's pickled three), keep
    what the steps change in the parameter groups (a step count: reloaded from the real groups at every update it
    never advanced), and step at once an optimizer whose step couples its parameters (a global norm, a count per
    call), each silently different from the user's optimizer before (pytorch_optimizer's Lamb 1e-1 relative)."""
    model, data = mlp(), batches(4, per_step)  # (two batches a step: gradient accumulation)
    lrs = [0.05, 0.04, 0.03, 0.02]  # a scheduler's changes still reach the shadow
    want = staleness_one_reference(model, data, kind=kind, lrs=lrs)
    got, opt = run_async(
        copy.deepcopy(model), data, 1, kind=kind, lrs=lrs, optimizer_on=place, microbatches_per_round=2
    )
    assert (got - want).norm() <= 1e-6 * want.norm()
    if kind == "own":
        assert all(set(s) == {"buf"} for s in opt.state.values()) and not opt.initialized  # the real never stepped
    if kind == "counted":
        assert opt.param_groups[0]["step"] == 4  # the steps' count reached the real group at the flush


@pytest.mark.timeout(60)
@pytest.mark.parametrize("place", ["host", "device"])
def test_a_step_count_kept_in_the_groups_survives_a_checkpoint(place):
    model, data = mlp(), batches(6)
    whole, _ = run_async(copy.deepcopy(model), data, 1, kind="counted", optimizer_on=place)
    first = copy.deepcopy(model)
    opt = make_optimizer(first.parameters(), "counted")
    engine = PipelineEngine(list(first.children()), [WorkerDevice("cpu")], asynchronous=True, optimizer_on=place)
    try:
        _train(engine, opt, data[:3])
        state = engine.state_dict()
        saved = (copy.deepcopy(first.state_dict()), copy.deepcopy(opt.state_dict()), copy.deepcopy(state))
    finally:
        engine.close()
    assert saved[1]["param_groups"][0]["step"] == 3
    resumed = mlp(seed=1)
    engine = PipelineEngine(list(resumed.children()), [WorkerDevice("cpu")], asynchronous=True, optimizer_on=place)
    try:
        resumed.load_state_dict(saved[0])
        opt = make_optimizer(resumed.parameters(), "counted")
        opt.load_state_dict(saved[1])
        engine.load_state_dict(saved[2])
        _train(engine, opt, data[3:])
    finally:
        engine.close()
    assert torch.equal(_flat(resumed), whole) and opt.param_groups[0]["step"] == 6


@pytest.mark.timeout(60)
def test_a_frozen_base_stays_on_the_host_and_the_adapters_equal_the_host_optimizers():
    """LoRA's shape (the default ``"auto"`` puts its small trainable part on the GPU): frozen layers stream from
    the host as before; only the trainable groups' states live on the device, with the host optimizer's result."""
    model, data = mlp(), batches(4)
    for layer in (model[0], model[4]):
        layer.requires_grad_(False)
    frozen = [p.detach().clone() for p in (*model[0].parameters(), *model[4].parameters())]
    runs = {}
    for place in ("host", "device", 0.5):
        trained = copy.deepcopy(model)
        runs[place], _ = run_async(trained, data, 1, microbatches_per_round=2, optimizer_on=place)
        assert all(torch.equal(a, b) for a, b in zip(frozen, (*trained[0].parameters(), *trained[4].parameters())))
    assert torch.equal(runs["device"], runs["host"]) and torch.equal(runs[0.5], runs["host"])
    assert not torch.equal(runs["device"], _flat(model))  # the adapters trained


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("clip", "algorithm"), [(0.05, "norm"), (0.01, "value")])
@pytest.mark.parametrize("place", ["device", 0.5])  # (a share: the norm over the device's groups and the host's)
def test_clipping_and_hyperparameters_are_taken_at_submission(clip, algorithm, place):
    model, data, lrs = mlp(), batches(4), [0.05, 0.02, 0.01, 0.005]
    want = staleness_one_reference(model, data, clip, algorithm, lrs, kind="sgd")
    got, opt = run_async(copy.deepcopy(model), data, 1, clip, algorithm, lrs, kind="sgd", optimizer_on=place)
    assert (got - want).norm() <= 1e-5 * want.norm()
    assert all("momentum_buffer" in s for s in opt.state.values())


def _engine(model, **kwargs) -> PipelineEngine:
    return PipelineEngine(
        list(model.children()), [WorkerDevice("cpu")], asynchronous=True, optimizer_on="device", **kwargs
    )


def _train(engine, opt, data, norm=False) -> None:
    for (x, y), *_ in data:
        engine.train_batch(x, y, F.mse_loss)
        engine.submit_step(UpdateSpec.capture(opt, measure_norm=norm))


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.timeout(60)
def test_the_modules_weights_follow_the_updates_during_training_as_with_the_host_optimizer():
    """What a callback reads every batch (an EMA of the weights) must not sit at the last flush: each update's
    master is copied to the host, and that copy is not taken for a user's edit."""
    model, data, seen = mlp(), batches(4), {}
    for place in ("host", "device"):
        trained = copy.deepcopy(model)
        engine = PipelineEngine(list(trained.children()), [WorkerDevice("cpu")], asynchronous=True, optimizer_on=place)
        opt, seen[place] = make_optimizer(trained.parameters()), []
        try:
            for (x, y), *_ in data:
                engine.train_batch(x, y, F.mse_loss)
                engine.submit_step(UpdateSpec.capture(opt))
                engine.crew.optimizer.wait_math()  # the update applied to the masters; no flush
                seen[place].append(_flat(trained))
                if place == "device":
                    assert not engine.resident.host_changed()
        finally:
            engine.close()
    assert all(torch.equal(a, b) for a, b in zip(seen["device"], seen["host"]))
    assert not torch.equal(seen["device"][0], seen["device"][-1])


@pytest.mark.timeout(120)
def test_a_callback_sees_the_weights_move_through_lightning():
    import lightning as L
    from helpers import BoringPipeline, fit

    from lightning_roundpipe import RoundPipeStrategy

    class Watch(L.Callback):
        def __init__(self):
            self.seen = []

        def on_train_batch_end(self, trainer, pl_module, *args):
            self.seen.append(next(pl_module.parameters()).detach().clone())

    watch = Watch()
    strategy = RoundPipeStrategy(optimizer_on="device")
    fit(BoringPipeline, {"accelerator": "cpu", "devices": 1, "strategy": strategy, "callbacks": [watch]})
    assert len(watch.seen) == 8 and not torch.equal(watch.seen[0], watch.seen[-1])


@pytest.mark.timeout(60)
def test_the_gradient_norm_is_measured_on_the_device():
    model, data, norms = mlp(), batches(4), []
    staleness_one_reference(model, data, norms=norms)
    engine = _engine(model)
    try:
        _train(engine, make_optimizer(model.parameters()), data, norm=True)
        engine.flush()
        got = [n for _, n in engine.crew.optimizer.grad_norms]
    finally:
        engine.close()
    assert got == pytest.approx(norms, rel=1e-5)


@pytest.mark.timeout(60)
def test_a_checkpoint_resumes_exactly_and_the_masters_reach_the_module():
    model, data = mlp(), batches(6)
    whole = copy.deepcopy(model)
    engine = _engine(whole)
    try:
        _train(engine, make_optimizer(whole.parameters()), data)
    finally:
        engine.close()  # the device's masters come back into the module
    want = staleness_one_reference(model, data)
    assert (_flat(whole) - want).norm() <= 1e-5 * want.norm()

    first = copy.deepcopy(model)
    opt = make_optimizer(first.parameters())
    engine = _engine(first)
    try:
        _train(engine, opt, data[:3])
        state = engine.state_dict()  # flushed: the host holds the masters, states and the next step's weights
        saved = (copy.deepcopy(first.state_dict()), copy.deepcopy(opt.state_dict()), copy.deepcopy(state))
        _train(engine, opt, data[3:])  # the run goes on after its checkpoint
    finally:
        engine.close()
    assert torch.equal(_flat(first), _flat(whole))

    resumed = mlp(seed=1)  # other weights, replaced by the checkpoint's
    engine = _engine(resumed)
    try:
        resumed.load_state_dict(saved[0])
        opt = make_optimizer(resumed.parameters())
        opt.load_state_dict(saved[1])
        engine.load_state_dict(saved[2])
        _train(engine, opt, data[3:])
    finally:
        engine.close()
    assert torch.equal(_flat(resumed), _flat(whole))


@pytest.mark.timeout(60)
def test_each_flush_writes_the_states_into_the_hosts_tensors_of_the_last():
    """Every validation or checkpoint flushes: the states come back into the host tensors the last flush made
    (no new memory each time), holding what the host optimizer's own states hold."""
    model, data = mlp(), batches(6)
    states = {}
    for place in ("host", "device"):
        trained = copy.deepcopy(model)
        opt = make_optimizer(trained.parameters())
        engine = PipelineEngine(list(trained.children()), [WorkerDevice("cpu")], asynchronous=True, optimizer_on=place)
        try:
            _train(engine, opt, data[:3])
            engine.flush()
            first = {(id(p), k): v.data_ptr() for p, s in opt.state.items() for k, v in s.items()}
            before = copy.deepcopy(opt.state_dict())
            _train(engine, opt, data[3:])
            engine.flush()
            if place == "device":
                assert {(id(p), k): v.data_ptr() for p, s in opt.state.items() for k, v in s.items()} == first
            assert not torch.equal(opt.state_dict()["state"][0]["exp_avg"], before["state"][0]["exp_avg"])
            states[place] = copy.deepcopy(opt.state_dict()["state"])
        finally:
            engine.close()
    assert states["device"].keys() == states["host"].keys()
    for i, entry in states["host"].items():
        assert all(torch.equal(entry[k], states["device"][i][k]) for k in entry)


@pytest.mark.timeout(60)
def test_evaluation_between_steps_sees_the_masters_and_leaves_training_as_it_was():
    model, data = mlp(), batches(5)
    x, y = batches(1, size=8)[0][0]
    results = {}
    for place in ("host", "device"):
        trained = copy.deepcopy(model)
        opt = make_optimizer(trained.parameters())
        engine = PipelineEngine(list(trained.children()), [WorkerDevice("cpu")], asynchronous=True, optimizer_on=place)
        losses = []
        try:
            for t, ((bx, by), *_) in enumerate(data):
                engine.train_batch(bx, by, F.mse_loss)
                engine.submit_step(UpdateSpec.capture(opt))
                if t in (1, 3):
                    engine.begin_evaluation()
                    losses.append(float(engine.evaluate(x, y, F.mse_loss)))
                    masters = copy.deepcopy(trained)
                    engine.end_evaluation()
                    losses.append(
                        float(F.mse_loss(masters(x), y).detach())
                    )  # what plain evaluation of the masters gives
        finally:
            engine.close()
        results[place] = (losses, _flat(trained))
    assert results["device"][0] == pytest.approx(results["host"][0], rel=1e-6)
    assert results["device"][0][0::2] == pytest.approx(results["device"][0][1::2], rel=1e-6)
    assert torch.equal(results["device"][1], results["host"][1])


@pytest.mark.timeout(60)
def test_an_edit_on_the_host_during_training_is_replaced_by_the_devices_values_with_a_warning():
    model, data = mlp(), batches(4)
    opt = make_optimizer(model.parameters())
    engine = _engine(model)
    try:
        _train(engine, opt, data[:2])
        with torch.no_grad():
            next(model.parameters()).zero_()
        with pytest.warns(UserWarning, match="changed on the host during training") as said:
            _train(engine, opt, data[2:])
        assert "RoundPipeStrategy(optimizer_on='host') to keep edits made between steps" in str(said[0].message)
        engine.flush()
        assert next(model.parameters()).abs().sum() > 0
    finally:
        engine.close()


def test_the_device_optimizer_is_refused_where_it_cannot_run():
    """Before any thread starts (none is left behind)."""
    model = mlp()
    devices = [WorkerDevice("cpu", i) for i in range(2)]
    with pytest.raises(ValueError, match="one worker device"):
        PipelineEngine(list(model.children()), devices, asynchronous=True, optimizer_on="device")
    with pytest.raises(ValueError, match="one worker device"):
        PipelineEngine(list(mlp().children()), devices[:1], optimizer_on="device")
    with pytest.raises(ValueError, match="not one of"):
        PipelineEngine(list(mlp().children()), devices[:1], asynchronous=True, optimizer_on="gpu")
    with pytest.raises(ValueError, match="too much of"):
        PipelineEngine(
            list(mlp().children()), devices[:1], asynchronous=True, optimizer_on="device", memory_limit=1000.0
        )
    assert not [t for t in threading.enumerate() if t.name.startswith("roundpipe-")]


@pytest.mark.timeout(60)
def test_the_device_takes_the_hosts_values_only_when_the_host_changed_them(monkeypatch):
    from lightning_roundpipe.runtime.resident import ResidentStates

    taken, from_host = [], ResidentStates.from_host
    monkeypatch.setattr(ResidentStates, "from_host", lambda self, step: taken.append(step) or from_host(self, step))
    model, data = mlp(), batches(6)
    opt = make_optimizer(model.parameters())
    engine = _engine(model)
    try:
        _train(engine, opt, data[:3])
        engine.state_dict()  # a checkpoint's flush: the host gets the device's values, nothing changes there
        _train(engine, opt, data[3:5])
        engine.flush()  # the host's view is the device's again, and then is loaded anew (a new state dict):
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        _train(engine, opt, data[5:])
    finally:
        engine.close()
    assert taken == [0, 5]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("extra", [{}, {"gradient_clip_val": 0.05}, {"accumulate_grad_batches": 2}])
def test_through_lightning_the_weights_equal_the_host_optimizers(extra):
    from helpers import BoringPipeline, fit, flat_weights

    from lightning_roundpipe import RoundPipeStrategy

    def factory():
        return BoringPipeline(scheduler=True)

    def trained(place: str):
        strategy = RoundPipeStrategy(num_microbatches=3, optimizer_on=place)
        return flat_weights(fit(factory, {"accelerator": "cpu", "devices": 1, "strategy": strategy, **extra}))

    host, device, share = trained("host"), trained("device"), trained(0.5)
    assert (device - host).norm() <= 1e-6 * host.norm()
    assert (share - host).norm() <= 1e-6 * host.norm()


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("kind", "place"), [("adamw", "device"), ("adamw", 0.5), ("counted", "device"), ("counted", "host")]
)
def test_through_lightning_a_resumed_run_equals_an_uninterrupted_one(tmp_path, kind, place):
    """``counted``: a step count kept in the optimizer's groups, which the checkpoint must hold."""
    import lightning as L
    from helpers import BoringPipeline, boring_data, flat_weights

    from lightning_roundpipe import RoundPipeStrategy

    class Module(BoringPipeline):
        def configure_optimizers(self):
            if kind == "adamw":
                return super().configure_optimizers()
            opt = make_optimizer(self.parameters(), kind)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}

    def run(epochs: int, where: str, ckpt: str | None = None):
        L.seed_everything(1, verbose=False)
        module = Module(scheduler=True)
        trainer = L.Trainer(
            strategy=RoundPipeStrategy(num_microbatches=3, plan="3,2|4,2,3", optimizer_on=place),
            accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[L.pytorch.callbacks.ModelCheckpoint(tmp_path / where, filename="{epoch}", save_top_k=-1)],
        )  # fmt: skip
        trainer.fit(module, boring_data(), ckpt_path=ckpt)
        return flat_weights(module)

    straight = run(2, "straight")
    run(1, "first")
    checkpoint = tmp_path / "first" / "epoch=0.ckpt"
    assert "compute" in torch.load(checkpoint, weights_only=False)["roundpipe"]  # an update pending at the save
    resumed = run(2, "resumed", str(checkpoint))
    assert (resumed - straight).norm() <= 1e-6 * straight.norm()


def test_the_strategy_refuses_the_device_optimizer_without_the_asynchronous_one():
    from lightning_roundpipe import RoundPipeStrategy

    with pytest.raises(ValueError, match="async_optimizer=True"):
        RoundPipeStrategy(async_optimizer=False, optimizer_on="device")
    with pytest.raises(ValueError, match="'host', 'device', 'auto' or a share"):
        RoundPipeStrategy(optimizer_on="gpu")


@pytest.mark.timeout(60)
def test_loss_scaling_is_refused_in_the_main_thread():
    model = mlp()
    opt = make_optimizer(model.parameters())
    engine = _engine(model)
    try:
        (x, y), *_ = batches(1)[0]
        engine.train_batch(x, y, F.mse_loss)
        spec = UpdateSpec.capture(opt, scaler=torch.amp.GradScaler("cpu"), loss_scale=2.0**16)
        with pytest.raises(ValueError, match="16-mixed"):
            engine.submit_step(spec)
        engine.submit_step(UpdateSpec.capture(opt))  # nothing was handed over: the step goes on unscaled
        engine.flush()
    finally:
        engine.close()


def test_the_plan_is_made_under_the_limit_less_the_states_and_the_cache_is_judged_by_the_whole_limit():
    from lightning_roundpipe.runtime.placement import resident_bytes

    engine = _engine(mlp(), memory_limit=1e9)
    try:
        need = resident_bytes(engine.store)
        assert need == sum(p.numel() for p in engine.store.parameters) * (4 + 4 + 2 * 4 + 8)  # fp32 CPU copies
        assert (engine.planner.memory_limit, engine.caches.ceiling) == (1e9 - need, 1e9)
    finally:
        engine.close()


def _interacted(place: str, scenario: str) -> torch.Tensor:
    """Five steps of two batches, with what a user or Lightning may do in the middle of them."""
    model, data = mlp(), batches(5, 2)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params[:4] if scenario == "a group added" else params, lr=0.05, weight_decay=0.1)
    engine = PipelineEngine(
        list(model.children()), [WorkerDevice("cpu")], asynchronous=True, optimizer_on=place, microbatches_per_round=2
    )
    try:
        for t, step_batches in enumerate(data):
            for i, (x, y) in enumerate(step_batches):
                engine.train_batch(x, y, F.mse_loss, grad_scale=0.5)
                if (t, i) == (2, 0) and scenario == "a flush and an edit in the middle of a step":
                    engine.state_dict()  # a checkpoint (or validation) between a step's batches, then
                    with torch.no_grad():  # an in-place write of the same values (an EMA swapped back, say)
                        params[0].copy_(params[0].clone())
            if t == 2 and scenario == "a group added":
                opt.add_param_group({"params": params[4:], "lr": 0.02})
            engine.submit_step(UpdateSpec.capture(opt))
            if t == 2 and scenario == "a flush and a prune through p.data":
                engine.flush()  # (a checkpoint, say) then a mask written past the version counters
                params[2].data.mul_((params[2].data.abs() > 0.1).to(params[2].dtype))
            if t == 2 and scenario.startswith("the states edited"):
                engine.flush()  # the host holds the device's states, then the user changes them
                for entry in opt.state.values():
                    if scenario.endswith("in place"):
                        entry["exp_avg_sq"].mul_(100.0)
                    else:
                        entry["exp_avg_sq"] = entry["exp_avg_sq"] * 100.0
        engine.flush()
    finally:
        engine.close()
    return _flat(model)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "scenario",
    [
        "a flush and an edit in the middle of a step",
        "a flush and a prune through p.data",  # taken up by the device (it replaced the mask before)
        "a group added",
        "the states edited in place",
        "the states edited by replacement",
    ],
)
def test_what_the_host_does_between_batches_counts_as_with_the_host_optimizer(scenario):
    assert torch.equal(_interacted("device", scenario), _interacted("host", scenario))


@pytest.mark.timeout(60)
def test_after_a_failure_the_module_holds_the_updates_the_device_made():
    def failing(place: str) -> tuple[torch.Tensor, int]:
        model, data = mlp(), batches(6)
        opt = make_optimizer(model.parameters())
        engine = PipelineEngine(list(model.children()), [WorkerDevice("cpu")], asynchronous=True, optimizer_on=place)

        def loss(a, b):
            raise RuntimeError("the user's loss failed")

        try:
            with pytest.raises(RuntimeError, match="the user's loss failed"):
                for t, ((x, y), *_) in enumerate(data):
                    if t == 4:  # the last update's math done first: a failure cuts a running one short (both ways)
                        engine.crew.optimizer.wait_math()
                    engine.train_batch(x, y, loss if t == 4 else F.mse_loss)
                    engine.submit_step(UpdateSpec.capture(opt))
        finally:
            engine.close()
        return _flat(model), len(opt.state)

    host, device = failing("host"), failing("device")
    assert torch.equal(device[0], host[0]) and device[1] == host[1] > 0


@pytest.mark.parametrize(
    ("workers", "limit", "layerwise", "on_device"),
    [
        (1, 1e9, True, True),  # a GPU with room: the device
        (1, None, True, False),  # CPU workers (no limit): the host
        (2, 1e9, True, False),  # several workers: the host
        (1, 1e9, False, False),  # the blocking (barrier) variant: the host
        (1, "tight", True, False),  # states over half the limit: the host
        (1, 1e9, "fp16", False),  # fp16 autocast (16-mixed scales its losses): the host
    ],
)
def test_auto_puts_the_states_on_the_device_only_where_they_fit_on_one(workers, limit, layerwise, on_device):
    from lightning_roundpipe.runtime.placement import resident_bytes

    model = mlp()
    probe = PipelineEngine(list(copy.deepcopy(model).children()), [WorkerDevice("cpu")], asynchronous=True)
    need = resident_bytes(probe.store)
    probe.close()
    limit = 1.9 * need if limit == "tight" else limit
    engine = PipelineEngine(
        list(model.children()), [WorkerDevice("cpu", i) for i in range(workers)], asynchronous=True,
        optimizer_on="auto", memory_limit=limit, consistency="layerwise" if layerwise else "barrier",
        autocast_dtype=torch.float16 if layerwise == "fp16" else None,
    )  # fmt: skip
    try:
        assert (engine.resident is not None) == on_device
        assert engine.planner.memory_limit == (limit - need if on_device else limit)
    finally:
        engine.close()


class _OwnAdamW(torch.optim.AdamW):
    """An optimizer from outside ``torch.optim`` (its step may need the host): ``"auto"`` leaves it there."""


_OwnAdamW.__module__ = "someones.optimizers"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("optimizer", "why"),
    [
        (torch.optim.AdamW, "CPU workers"),  # the default; CPU workers have no memory limit
        (_OwnAdamW, "_OwnAdamW is not one of torch.optim's, whose steps run on a GPU as on the host"),
    ],
)
def test_auto_through_lightning_says_where_the_states_are_and_why(caplog, optimizer, why):
    import logging

    from helpers import BoringPipeline, fit

    from lightning_roundpipe import RoundPipeStrategy

    class Module(BoringPipeline):
        def configure_optimizers(self):
            return optimizer(self.parameters(), lr=0.01)

    with caplog.at_level(logging.INFO):
        fit(Module, {"accelerator": "cpu", "devices": 1, "strategy": RoundPipeStrategy()})
    assert f"roundpipe: the optimizer's states in host memory (optimizer_on='auto': {why}" in caplog.text


@pytest.mark.parametrize(
    ("nodes", "autocast", "optimizer", "place"),
    [
        (1, None, torch.optim.SGD, "auto"),  # left to the engine's rules (one GPU, the states' size)
        (2, None, torch.optim.SGD, "host"),
        (1, torch.float16, torch.optim.SGD, "host"),
        (1, torch.bfloat16, _OwnAdamW, "host"),
    ],
)
def test_the_strategys_reasons_for_the_host(nodes, autocast, optimizer, place):
    from lightning_roundpipe.build import _place

    opt = optimizer([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    assert _place("auto", nodes, autocast, [opt])[0] == place
    assert _place("device", nodes, autocast, [opt]) == ("device", "")  # asked for: the engine refuses or runs it


class _CudaOnly(torch.optim.SGD):
    """An optimizer whose kernels need GPU tensors (a probe on the host's CPU tensors fails as theirs does)."""


@pytest.mark.timeout(120)
def test_an_optimizer_that_needs_a_gpu_is_left_to_the_device_and_refused_only_where_it_cannot_go(monkeypatch, caplog):
    """Its states can live only on a GPU: 'auto' does not keep it on the host for being outside torch.optim, and
    with the states on the device the host's CPU probe does not refuse it; where they cannot go there (CPU workers
    here), the refusal names optimizer_on='device'."""
    import lightning as L
    from helpers import BoringPipeline, fit

    from lightning_roundpipe import RoundPipeStrategy, host_optimizer
    from lightning_roundpipe.build import _place

    real_probe = host_optimizer._probe_step

    def probe(optimizer, group):
        if isinstance(optimizer, _CudaOnly):
            return RuntimeError("the fused kernel takes CUDA tensors only")
        return real_probe(optimizer, group)

    monkeypatch.setattr(host_optimizer, "_probe_step", probe)
    assert _place("auto", 1, torch.bfloat16, [_CudaOnly([torch.nn.Parameter(torch.zeros(2))], lr=0.1)]) == ("auto", "")

    class Module(BoringPipeline):
        def configure_optimizers(self):
            return _CudaOnly(self.parameters(), lr=0.05)

    with pytest.raises(ValueError, match=r"need a GPU cannot run there: .*optimizer_on='device'"):
        fit(Module, {"accelerator": "cpu", "devices": 1, "strategy": RoundPipeStrategy(num_microbatches=2)})
    module = fit(Module, {"accelerator": "cpu", "devices": 1, "strategy": RoundPipeStrategy(optimizer_on="device")})
    assert isinstance(module, L.LightningModule) and module.trainer.global_step > 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("place", ["host", "device"])
def test_the_upload_rate_is_timed_on_what_really_goes_up(monkeypatch, place):
    """The planner charges stage boundaries by the upload rate it timed on the first slot's weights: with the states
    on the device those do not go up, so the rate comes from the copies the device takes from the host instead."""
    from lightning_roundpipe.runtime.profile import TransferRate

    seen, measure = [], TransferRate.measure
    monkeypatch.setattr(
        TransferRate, "measure", lambda self, flight: seen.append(flight.first_upload_bytes) or measure(self, flight)
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.Tanh(), torch.nn.Linear(4096, 8))  # 16.9 MB
    engine = PipelineEngine(
        list(model.children()), [WorkerDevice("cpu")], asynchronous=True, optimizer_on=place, plan="auto",
        profile_steps=1, microbatches_per_round=1,
    )  # fmt: skip
    opt = make_optimizer(model.parameters())
    try:
        for _ in range(3):
            engine.train_batch(torch.randn(4, 1024), torch.randn(4, 8), F.mse_loss)
            engine.submit_step(UpdateSpec.capture(opt))
        engine.flush()
        rate = engine.planner.transfers.upload_rate
    finally:
        engine.close()
    first_layer = 1024 * 4096 * 4 + 4096 * 4  # the first slot of the measuring plan: one layer, 16.8 MB
    assert seen and set(seen) == ({first_layer} if place == "host" else {0})  # the device's: nothing went up
    assert rate > 0  # from that upload, or from the device's copies as it took them from the host


@pytest.mark.timeout(60)
def test_a_share_of_the_states_on_the_device_holds_the_deepest_groups_and_refuses_a_coupled_optimizer():
    """``optimizer_on=0.5``: the deepest groups' states on the device (their gradients complete first in the
    backward), the rest the host's; an optimizer whose step couples the parameters cannot be stepped in two places."""
    model, data = mlp(), batches(2)
    engine = PipelineEngine(list(model), [WorkerDevice("cpu")], asynchronous=True, optimizer_on=0.5)
    try:
        trainable = [g.index for g in engine.store.groups if g.trainable]
        sizes = {g.index: g.data.numel() for g in engine.store.groups}
        held = engine.resident.groups
        assert held == tuple(trainable[-len(held) :]) and 0 < len(held) < len(trainable)
        assert sum(sizes[g] for g in held) <= 0.5 * sum(sizes[g] for g in trainable)
        opt = make_optimizer(model.parameters(), "counted")
        with pytest.raises(RuntimeError, match="couples its parameters, and a share of the states on the device"):
            _train(engine, opt, data)
            engine.flush()
    finally:
        engine.close()
    with pytest.raises(ValueError, match=r"optimizer_on=1\.5 is not one of"):
        PipelineEngine(list(mlp()), [WorkerDevice("cpu")], asynchronous=True, optimizer_on=1.5)
    engine = PipelineEngine(list(mlp()), [WorkerDevice("cpu")], asynchronous=True, optimizer_on=0.5, double_buffer=True)
    try:  # double buffering for the host's groups (the device holds two copies of its own)
        spares = {g.index: g.spare is not None for g in engine.store.groups if g.trainable}
        assert spares == {g: g not in engine.resident.held for g in spares}
    finally:
        engine.close()


@pytest.mark.timeout(60)
def test_through_lightning_a_share_refuses_at_setup_what_only_the_host_or_one_place_could_step():
    """A share of the states on the GPU leaves the rest to the host: an optimizer the host cannot step (a kernel
    that needs a GPU) or one whose step couples its parameters is refused before the first batch, saying why."""
    from helpers import BoringPipeline, fit

    from lightning_roundpipe import RoundPipeStrategy

    class NeedsAGpu(torch.optim.SGD):
        def step(self, closure=None):
            raise RuntimeError("this kernel needs a CUDA device")

    coupled = r"couples its parameters .*, and the GPU and the host \(a share\)"
    for make, said in ((lambda p: make_optimizer(p, "counted"), coupled),
                       (lambda p: NeedsAGpu(p, lr=0.1), "need a GPU cannot run there")):  # fmt: skip

        class Module(BoringPipeline):
            def configure_optimizers(self, make=make):
                return make(self.parameters())

        with pytest.raises(ValueError, match=said):
            fit(Module, {"accelerator": "cpu", "devices": 1, "strategy": RoundPipeStrategy(optimizer_on=0.5)})


@pytest.mark.timeout(60)
def test_a_checkpoint_after_an_announced_last_batch_saves_every_groups_copy_alike_with_a_share():
    """Between a step's announced last batch and its update (an exception checkpoint), the host's groups' compute
    copies hold the previous update (``settle_early_casts``); with a share on the device its groups' copies were
    saved one update behind, so a run resumed from there started on a mix of both."""
    model, data = mlp(), batches(3)
    opt = make_optimizer(model.parameters())
    engine = PipelineEngine(
        list(model), [WorkerDevice("cpu")], microbatches_per_round=2, asynchronous=True, optimizer_on=0.5
    )
    try:
        for t, [(x, y)] in enumerate(data):
            engine.train_batch(x, y, F.mse_loss, last_of_step=True)
            if t < 2:
                engine.submit_step(UpdateSpec.capture(opt))
        state = engine.state_dict()
        saved = state["compute"]
        assert 0 < len(engine.resident.held) < len(saved)
        for g, copy_ in saved.items():  # each the masters (every submitted update) in the compute dtype
            assert torch.equal(copy_, engine.store.groups[g].data.to(copy_.dtype)), g
    finally:
        engine.close()


class _SlowAdamW(torch.optim.AdamW):
    """AdamW whose step of each group takes a while: a failure in the next batch finds its update running."""

    def step(self, closure=None):
        time.sleep(0.03)
        return super().step(closure)


def _update_began(trace: list, step: int, group: int | None = None, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not any(e[0] == "update" and e[1] == step and group in (None, e[2]) for e in list(trace)):
        assert time.monotonic() < deadline, f"update {step} never began"
        time.sleep(0.002)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("place", ["host", "device"])
def test_a_failure_in_the_next_batch_lets_the_update_whose_gradients_landed_finish(place):
    """The module after a failed batch holds whole steps (what code that catches the error saves): the
    update running beside the failed batch had every gradient, so it finishes instead of stopping at its next group
    (which left some layers one update behind the rest)."""
    model, data = mlp(), batches(5)
    want = staleness_one_reference(model, data[:4])
    opt = _SlowAdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    engine = PipelineEngine(list(model.children()), [WorkerDevice("cpu")], asynchronous=True, optimizer_on=place)
    train_until_batch_five_fails(engine, opt, data)
    got = _flat(model)
    assert (got - want).norm() <= 1e-5 * want.norm()


def train_until_batch_five_fails(engine: PipelineEngine, opt: torch.optim.Optimizer, data: list) -> None:
    """Batches 0-4, the fifth's loss failing once update 3 began (its gradients landed, groups still to go)."""
    trace = engine.crew.record_trace()

    def loss(a, b):
        raise RuntimeError("the user's loss failed")

    try:
        with pytest.raises(RuntimeError, match="the user's loss failed"):
            for t, ((x, y),) in enumerate(data):
                if t == 4:
                    _update_began(trace, 3)
                engine.train_batch(x, y, loss if t == 4 else F.mse_loss)
                engine.submit_step(UpdateSpec.capture(opt))
    finally:
        engine.close()


class _FailsBackward:
    """A backward that fails in the fourth batch once its update began on the deep groups."""

    def __init__(self, trace: list) -> None:
        self.rows, self.trace = 0, trace

    def __call__(self, grad: torch.Tensor) -> None:
        self.rows += grad.shape[0]
        if self.rows > 3 * 12:  # (12 rows a batch)
            _update_began(self.trace, 3)
            raise RuntimeError("a backward failed")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("place", ["host", "device"])
def test_a_failure_in_a_backward_after_its_update_began_warns_that_the_weights_mix_two_steps(place):
    """Each group's update starts once its gradient is complete, beside the backward of the shallower layers: a
    failure there leaves the deep groups updated and the shallow ones not. That cannot be undone, so it is said.
    (On the host with one copy of the weights, an update starts only after the previous one's casts, which wait
    for the last read of each group, in the backward: double buffering lets it start sooner.)"""
    model, data, failing = mlp(), batches(5), _FailsBackward([])
    layers = list(model.children())
    engine = PipelineEngine(
        [layers[0], BackwardHook(failing), *layers[1:]], [WorkerDevice("cpu")], asynchronous=True,
        optimizer_on=place, double_buffer=place == "host",
    )  # fmt: skip
    opt = make_optimizer(model.parameters())
    failing.trace = engine.crew.record_trace()
    try:
        mixed = r"stopped an update after [123] of its 4 parameter groups"
        with pytest.raises(RuntimeError, match="a backward failed"), pytest.warns(UserWarning, match=mixed):
            for (x, y), *_ in data:
                engine.train_batch(x, y, F.mse_loss)
                engine.submit_step(UpdateSpec.capture(opt))
            engine.flush()
    finally:
        engine.close()


@pytest.mark.timeout(60)
def test_a_batch_given_up_before_dispatch_lets_the_running_update_finish_before_a_save(monkeypatch):
    """A failure between building a batch and dispatching it (staging, Ctrl-C) marks the engine failed without a
    worker error: it stops the threads as any failure does, so the update running beside it finishes before a
    checkpoint reads the weights (it was still running, and the save refused or read half an update)."""
    from lightning_roundpipe.runtime.flight import Flight

    model, data = mlp(), batches(5)
    want = staleness_one_reference(model, data[:4])
    opt = _SlowAdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    engine = PipelineEngine(list(model.children()), [WorkerDevice("cpu")], asynchronous=True)
    trace = engine.crew.record_trace()
    try:
        for (x, y), *_ in data[:4]:
            engine.train_batch(x, y, F.mse_loss)
            engine.submit_step(UpdateSpec.capture(opt))
        _update_began(trace, 3)

        def put(*args, **kwargs):
            raise RuntimeError("staging failed")

        monkeypatch.setattr(Flight, "put", put)
        with pytest.raises(RuntimeError, match="staging failed"):
            engine.train_batch(*data[4][0], F.mse_loss)
        assert engine.crew.failed and engine.crew.whole_after_failure()
        state = engine.state_dict()  # what Lightning's OnExceptionCheckpoint saves with the weights
        assert "compute" not in state and state["step"] == 4
        got = _flat(model)
    finally:
        engine.close()
    assert (got - want).norm() <= 1e-5 * want.norm()
