"""The host's step against the devices': the warning, and optimizer_on="auto"'s share of the states moved to the
GPU where the host bounds the step (CPU workers stand in: the share is offered by hand, the clock's judgement needs
a GPU's compute time)."""

import warnings
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from helpers import BoringPipeline, boring_data, fit, flat_weights, relative_error

from lightning_roundpipe import RoundPipeStrategy, build, host_clock
from lightning_roundpipe.engine import PipelineEngine
from lightning_roundpipe.engine.cache import CacheWatch
from lightning_roundpipe.engine.state import engine_state
from lightning_roundpipe.host_clock import HostStepClock, ShareSwitch
from lightning_roundpipe.runtime.device import WorkerDevice
from lightning_roundpipe.runtime.host_store import HostStore
from lightning_roundpipe.runtime.placement import SHARE_FLOOR, STATES_MOST, resident_bytes, share_for
from lightning_roundpipe.strategy import _engine_arguments


def test_a_host_step_longer_than_the_devices_is_reported_once_when_settled():
    clock = HostStepClock()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        clock.record(1, 12.0, 1.0)  # the first steps allocate the optimizer's states: not judged
        clock.record(2, 9.0, 1.0)
        for step in range(3, 8):
            clock.record(step, 0.5, 1.0)  # hidden behind the devices' step: nothing to say
        clock.record(8, 3.0, 1.0)  # one slow step among settled ones (the median of three is 0.5)...
        assert clock.host_step_s == 3.0
        clock.record(8, 3.0, 1.0)  # ...and the same update seen again is not counted twice
        clock.record(9, 2.0, None)  # the devices' step not measured yet
    with pytest.warns(UserWarning, match=r"takes 3.00 s, longer than the 1.00 s the devices compute"):
        clock.record(10, 3.0, 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        clock.record(11, 3.0, 1.0)  # once
    synchronous = HostStepClock()  # no step numbers: each call is a step of its own
    with pytest.warns(UserWarning, match=r"takes 2.00 s"):
        for _ in range(synchronous.settle + synchronous.window):
            synchronous.record(None, 2.0, 1.0)


def test_a_host_step_judged_longer_is_offered_first_and_warned_only_where_not_taken():
    clock, offered = HostStepClock(), []
    clock.on_bound = lambda host, device: offered.append((host, device)) or len(offered) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(1, 6):
            clock.record(step, 3.0, 1.0)  # judged at step 5: offered, taken, no warning
    assert offered == [(3.0, 1.0)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        clock.record(6, 3.0, 1.0)
        clock.record(7, 3.0, 1.0)  # judged afresh on the steps after
    with pytest.warns(UserWarning, match=r"takes 3.00 s"):
        clock.record(8, 3.0, 1.0)  # not taken this time: the warning
    assert len(offered) == 2


def test_the_share_brings_the_host_under_the_devices_within_half_of_the_limit():
    store = HostStore([torch.nn.Linear(64, 64) for _ in range(4)], torch.bfloat16, separate_compute=True)
    states = resident_bytes(store)
    assert share_for(store, None, 2.0, 1.0) is None  # no limit: CPU workers
    assert share_for(store, 10 * states, 2.0, 1.0) == pytest.approx(0.6)  # 1 - 0.8 x 1.0 / 2.0
    assert share_for(store, states / 2, 2.0, 1.0) == pytest.approx(0.25)  # at most half of the limit
    assert share_for(store, 10 * states, 1.0, 1.2) is None  # 0.04 of the host's work: not worth half a plan
    assert share_for(store, states * 2 * SHARE_FLOOR * 0.9, 2.0, 1.0) is None  # too little fits


class _Offered(L.Callback):
    """Offers ``share`` at the fit's start, as the clock's judgement would on a GPU; ``freeze``: a bias frozen
    once the share runs (the engine then built again for the parameters trainable)."""

    def __init__(self, share: float, freeze: bool = False) -> None:
        self.share, self.freeze, self.engines = share, freeze, []

    def on_train_start(self, trainer, pl_module):
        switch: ShareSwitch = trainer.strategy._share
        switch.eligible, switch.share, switch._times = True, self.share, (2.0, 1.0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        engine = trainer.strategy.engine
        if not self.engines or self.engines[-1][1] is not engine:
            self.engines.append((trainer.global_step, engine, engine.resident))
            if self.freeze and len(self.engines) == 2:
                pl_module.model[0].bias.requires_grad_(False)


def _run(share: float, build=None, monkeypatch=None, freeze=False):
    if build is not None:
        monkeypatch.setattr(host_clock, "build_placed", build)
    offered = _Offered(share, freeze)
    kwargs = {"accelerator": "cpu", "devices": 1, "max_epochs": 3, "callbacks": [offered]}
    strategy = RoundPipeStrategy(num_microbatches=2)
    module = fit(lambda: BoringPipeline(depth=4), {**kwargs, "strategy": strategy}, boring_data(samples=192))
    return module, offered.engines, strategy


def _rebuilt_on_the_host(engine, arguments, place, seconds=None):
    """The reference: the engine built again on the host as for unfrozen parameters (counters carried only, the
    layers measured again), at the same batch."""
    if not engine.steps.between_steps():
        return None
    engine.flush()
    state = engine_state(engine, compute=False)
    again = build._rebuilt(engine, arguments)
    again.load_state_dict({k: state[k] for k in ("calls", "step", "dispatch_position", "base_seed")})
    return again


@pytest.mark.timeout(240)
def test_a_share_moved_during_training_trains_as_the_host_built_again_at_the_same_batch(monkeypatch):
    """The switch builds the engine again between steps (the pending update lands, the next batch computes on the
    latest weights): equal to the host's engine built again at the same batch, kept or not."""
    monkeypatch.setattr(CacheWatch, "gain", -1e9)  # (kept whatever the CPU's timing)
    kept, engines, strategy = _run(0.5)
    assert len(engines) == 2 and engines[0][2] is None
    resident = engines[1][2]
    assert resident is not None and not resident.whole
    assert strategy._share.outcome["kept"] is True and strategy.options.optimizer_on == "auto"
    steps = {int(state["step"]) for state in kept.trainer.optimizers[0].state.values()}
    assert steps == {kept.trainer.global_step}  # every state stepped once a step, on either side of the move
    host, host_engines, _ = _run(0.5, _rebuilt_on_the_host, monkeypatch)
    assert [e[0] for e in host_engines] == [e[0] for e in engines]  # built again at the same step
    assert relative_error(flat_weights(kept), flat_weights(host)) <= 1e-6
    start = fit(lambda: BoringPipeline(depth=4), {"accelerator": "cpu", "devices": 1, "max_steps": 0})
    assert relative_error(flat_weights(kept), flat_weights(start)) > 1e-3

    monkeypatch.setattr(CacheWatch, "gain", 1.0)  # never faster: the host again
    monkeypatch.setattr(host_clock, "build_placed", build.build_placed)
    back, engines, strategy = _run(0.5)
    assert len(engines) == 3 and engines[1][2] is not None and engines[2][2] is None
    assert strategy._share.outcome["kept"] is False
    on_host = lambda engine, arguments, place, *_: build.build_placed(engine, arguments, "host")  # noqa: E731
    twice, host_engines, _ = _run(0.5, on_host, monkeypatch)  # (the plan carried: the same batches again)
    assert [e[0] for e in host_engines] == [e[0] for e in engines]
    assert relative_error(flat_weights(back), flat_weights(twice)) <= 1e-6


def _start():
    return fit(lambda: BoringPipeline(depth=4), {"accelerator": "cpu", "devices": 1, "max_steps": 0})


class _Whole(_Offered):
    """Lets the switch weigh every state at the first plan, as on a GPU whose plan may use ``factor`` times the
    states' bytes (CPU workers have no limit)."""

    def __init__(self, factor: float, oom_at: int | None = None) -> None:
        super().__init__(0.0)
        self.factor, self.oom_at = factor, oom_at

    def on_train_start(self, trainer, pl_module):
        engine = trainer.strategy.engine
        trainer.strategy._share._whole = "first"
        engine.planner.memory_limit = self.factor * resident_bytes(engine.store)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if trainer.global_step == self.oom_at:  # as if this batch had run again after running out of memory
            trainer.strategy.engine.recovery.recovered += 1


@pytest.mark.timeout(180)
def test_every_state_moves_at_the_first_plan_where_one_as_fast_fits_beside_them(monkeypatch):
    """ShareSwitch.whole: before the first step on the first plan, every state to the GPU where the same plan fits
    beside them, without a trial; equal to the host's engine built again at the same batch."""
    moved = _Whole(1e6)
    strategy = RoundPipeStrategy(num_microbatches=2)
    kwargs = {"accelerator": "cpu", "devices": 1, "max_epochs": 3, "callbacks": [moved], "strategy": strategy}
    module = fit(lambda: BoringPipeline(depth=4), kwargs, boring_data(samples=192))
    assert len(moved.engines) == 2 and moved.engines[0][2] is None and moved.engines[1][2].whole
    outcome = strategy._share.outcome
    assert {k: outcome[k] for k in ("share", "kept", "judged")} == {"share": 1.0, "kept": True, "judged": False}
    assert set(outcome["seconds"]) == {"flush", "state", "build", "load", "plan"}  # where the move's time went
    assert all(s >= 0 for s in outcome["seconds"].values())
    assert strategy._share.weighed["as_fast"] is True and strategy.options.optimizer_on == "auto"
    assert [e[0] for e in moved.engines] == [1, 3]  # (two batches measure the layers; the third is on the plan)

    monkeypatch.setattr(host_clock, "build_placed", _rebuilt_on_the_host)
    host = _Whole(1e6)
    kwargs = {**kwargs, "callbacks": [host], "strategy": RoundPipeStrategy(num_microbatches=2)}
    reference = fit(lambda: BoringPipeline(depth=4), kwargs, boring_data(samples=192))
    assert [e[0] for e in host.engines] == [e[0] for e in moved.engines]  # built again at the same step
    assert relative_error(flat_weights(module), flat_weights(reference)) <= 1e-6
    assert relative_error(flat_weights(module), flat_weights(_start())) > 1e-3

    stays = _Whole(1.0)  # the states alone take the limit: nothing moves, and the record says so
    fit(lambda: BoringPipeline(depth=4), {**kwargs, "callbacks": [stays], "strategy": (kept := RoundPipeStrategy())})
    assert len(stays.engines) == 1 and kept._share.outcome is None and kept._share.weighed["beside"] is None


@pytest.mark.timeout(180)
def test_every_state_goes_back_to_the_host_once_a_batch_ran_out_of_memory_beside_them(monkeypatch):
    """The move is made for the lengths the first plan saw: where a later batch ran out of device memory beside the
    states (and ran again on a smaller plan), they go back to the host before the next step, once, with a warning;
    equal to the host's engine built again at the same batches."""

    def run(callback: _Whole) -> tuple[L.LightningModule, RoundPipeStrategy]:
        strategy = RoundPipeStrategy(num_microbatches=2)
        kwargs = {"accelerator": "cpu", "devices": 1, "max_epochs": 3, "callbacks": [callback], "strategy": strategy}
        return fit(lambda: BoringPipeline(depth=4), kwargs, boring_data(samples=192)), strategy

    moved = _Whole(1e6, oom_at=5)
    with pytest.warns(UserWarning, match="ran out of device memory beside every optimizer state"):
        module, strategy = run(moved)
    assert [(e[0], e[2] is not None) for e in moved.engines] == [(1, False), (3, True), (6, False)]
    assert strategy._share.outcome == {"share": 1.0, "kept": False, "judged": False}
    on_host = lambda engine, arguments, place, *_: build.build_placed(engine, arguments, "host")  # noqa: E731
    monkeypatch.setattr(host_clock, "build_placed", on_host)
    twice = _Whole(1e6, oom_at=5)
    with pytest.warns(UserWarning, match="ran out of device memory"):
        reference, _ = run(twice)
    assert [e[0] for e in twice.engines] == [1, 3, 6]
    assert relative_error(flat_weights(module), flat_weights(reference)) <= 1e-6


@pytest.mark.timeout(240)
def test_a_run_resumed_after_every_state_moved_moves_again_and_equals_the_uninterrupted_one(tmp_path):
    """The checkpoint saved with every state on the GPU resumes on the host (the default's placement) with the plan
    made beside them, which the first weighing then finds the same: every state moves again before the resumed run's
    first step. A move lands the pending update first (that batch computes on the latest weights, as at any engine
    built again), so the weights equal the uninterrupted run's with its engine built again at the same batch."""

    class _Rebuilt(_Whole):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 8 and self.engines[-1][2] is not None:
                strategy = trainer.strategy
                host_clock._install(
                    strategy, build.build_placed(strategy.engine, _engine_arguments(strategy), "device")
                )

    def run(epochs: int, where: str, ckpt: str | None = None, callback: _Whole | None = None):
        callback = callback or _Whole(1e6)
        keep = L.pytorch.callbacks.ModelCheckpoint(tmp_path / where, filename="{epoch}", save_top_k=-1)
        kwargs = {"accelerator": "cpu", "devices": 1, "max_epochs": epochs, "callbacks": [callback, keep]}
        kwargs |= {"strategy": RoundPipeStrategy(), "enable_checkpointing": True}
        L.seed_everything(1, verbose=False)
        module = BoringPipeline(depth=4)
        trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, **kwargs)
        trainer.fit(module, boring_data(samples=96), ckpt_path=ckpt)
        return flat_weights(module), callback

    straight, moved = run(2, "straight", callback=_Rebuilt(1e6))
    assert [(e[0], e[2] is not None) for e in moved.engines] == [(1, False), (3, True), (9, True)]
    run(1, "first")
    resumed, again = run(2, "resumed", str(tmp_path / "first" / "epoch=0.ckpt"))
    assert [(e[0], e[2] is not None) for e in again.engines] == [(9, True)]  # moved before its first step
    assert relative_error(resumed, straight) <= 1e-6


class _Planner:
    """A planner whose plan under a limit is ``plans[limit]``: (plan, micro-batches, simulated seconds a batch)."""

    def __init__(self, plans: dict[float, tuple[str, int, float]], limit: float, chooses: bool = True) -> None:
        self.plans, self.memory_limit, self.chooses_microbatches = plans, limit, chooses
        self.plan, self.microbatches_per_round, period = plans[limit]
        self.candidate_periods = {self.microbatches_per_round: period} if chooses else {}
        self.layer_costs = self.planned_elements = self.memory_elements = None

    def plan_for_memory(self, store, limit):
        if limit not in self.plans:
            return None
        plan, self.microbatches_per_round, period = self.plans[limit]
        self.candidate_periods = {self.microbatches_per_round: period} if self.chooses_microbatches else {}
        self.memory_limit = limit
        return plan


def test_every_state_moves_only_beside_a_plan_about_as_fast():
    store = HostStore([torch.nn.Linear(64, 64) for _ in range(4)], torch.bfloat16, separate_compute=True)
    states = resident_bytes(store)
    limit = 3.0 * states
    cases = [
        (("|4", 1, 1.0), True, True),
        (("|4", 1, 1.2), True, True),  # the same plan and count: as fast, whatever the simulation says
        (("2|1,1", 2, 1.04), True, True),  # within 1.05x
        (("2|1,1", 2, 1.2), True, False),
        (("2|1,1", 2, 1.0), False, False),  # a count given: no periods to compare, another plan is not as fast
    ]
    for beside, chooses, moves in cases:
        planner = _Planner({limit: ("|4", 1, 1.0), limit - states: beside}, limit, chooses)
        planner.microbatches_per_round = 3  # (what the running plan has since: left as it is)
        switch = ShareSwitch()
        assert switch._fits_whole(SimpleNamespace(planner=planner, store=store)) is moves
        assert (planner.microbatches_per_round, planner.memory_limit) == (3, limit)
        assert switch.weighed["as_fast"] is moves and switch.weighed["beside"] == beside[0]
    switch = ShareSwitch()
    planner = _Planner({limit: ("|4", 1, 1.0)}, limit)  # nothing fits beside them
    assert switch._fits_whole(SimpleNamespace(planner=planner, store=store)) is False
    assert switch.weighed["beside"] is None and planner.memory_limit == limit
    near = _Planner({1.2 * states: ("|4", 1, 1.0), 0.2 * states: ("|4", 1, 1.0)}, 1.2 * states)
    assert switch._fits_whole(SimpleNamespace(planner=near, store=store)) is False  # over 0.8 of the limit


def test_every_state_moves_once_settled_where_the_plan_beside_them_beats_the_host_as_it_runs():
    """Declined at the first plan (simulated 1.5x the running plan's seconds), every state moves once the plan
    settled where the workers' waits for the host stretch its batches' wall time more than that; small waits do not
    weigh."""
    store = HostStore([torch.nn.Linear(64, 64) for _ in range(4)], torch.bfloat16, separate_compute=True)
    limit = 3.0 * resident_bytes(store)
    cases = [  # a batch every 0.8 s
        ({"update reads": 0.25, "casts": 0.2, "launch": 0.5}, 0.8 / 0.35, True),  # 1.5 x 1.05 <= 2.29
        ({"update reads": 0.1, "casts": 0.1}, 0.8 / 0.6, False),  # 1.33: slower than the host as it runs
        ({"casts": 0.9}, ShareSwitch.stretch_most, True),  # (summed over a batch's stages, past its wall time)
        ({"casts": 0.05, "launch": 5.0}, None, False),  # under `waited` of the rest (launch: not the host's)
    ]
    for waits, stretch, moves in cases:
        planner = _Planner({limit: ("|4", 1, 1.0), limit - resident_bytes(store): ("2|1,1", 2, 1.5)}, limit)
        caches = SimpleNamespace(interval=lambda intervals=None: 0.8)
        engine = SimpleNamespace(planner=planner, store=store, worker_waits=waits, caches=caches)
        switch = ShareSwitch()
        assert switch._fits_whole(engine) is False and switch.weighed["simulated"] == 1.5
        assert switch._fits_waited(engine) is moves and switch.weighed["as_fast"] is moves
        waited = waits.get("update reads", 0) + waits["casts"]
        assert switch.weighed["waited_s"] == pytest.approx(waited) and switch.weighed["period_s"] == 0.8
        assert switch.weighed.get("stretch") == pytest.approx(stretch)
        assert switch.weighed["simulated"] == 1.5 if stretch else "stretch" not in switch.weighed
    unsettled = SimpleNamespace(
        worker_waits={"casts": 1.0}, caches=SimpleNamespace(interval=lambda intervals=None: None)
    )
    assert ShareSwitch()._fits_waited(unsettled) is False
    slow = _Planner({limit: ("|4", 1, 1.0), limit - resident_bytes(store): ("2|1,1", 2, 3.5)}, limit)
    waiting = SimpleNamespace(planner=slow, store=store, worker_waits={"casts": 5.0}, caches=caches)
    assert ShareSwitch()._fits_waited(waiting) is False  # 3.5 > 1.05 x stretch_most: however long the waits


def _between(planner) -> SimpleNamespace:
    """An engine between steps on its first plan (what `_move_whole` reads), with ``planner``."""
    planner.fitted, planner.profile = object(), None
    store = HostStore([torch.nn.Linear(64, 64) for _ in range(4)], torch.bfloat16, separate_compute=True)
    steps = SimpleNamespace(between_steps=lambda: True)
    caches = SimpleNamespace(interval=lambda intervals=None: None)
    return SimpleNamespace(planner=planner, store=store, steps=steps, caches=caches, resident=None)


def test_the_waits_are_weighed_only_where_periods_compare_and_afresh_on_an_engine_built_elsewhere(monkeypatch):
    store_bytes = resident_bytes(_between(_Planner({1.0: ("|4", 1, 1.0)}, 1.0)).store)
    limit = 3.0 * store_bytes
    plans = {limit: ("|4", 1, 1.0), limit - store_bytes: ("2|1,1", 2, 1.5)}
    for chooses, armed in ((True, "waits"), (False, None)):  # a count given: no periods, nothing to weigh later
        engine, switch = _between(_Planner(plans, limit, chooses)), ShareSwitch()
        switch.watch(True)
        assert switch._move_whole(None, engine, lambda: None) is False and switch._whole == armed
    eligible = []
    monkeypatch.setattr(host_clock, "could_share", lambda engine, arguments: eligible.append(engine) or True)
    engine, switch = _between(_Planner(plans, limit)), ShareSwitch()
    switch.watch(True)
    strategy = SimpleNamespace(engine=engine)
    switch.apply(strategy, lambda: None)  # (the first weighing: declined)
    assert switch._whole == "waits" and not eligible
    strategy.engine = again = _between(_Planner(plans, limit))  # built again elsewhere (BackboneFinetuning...)
    switch.apply(strategy, lambda: None)
    assert eligible == [again] and switch._whole == "waits"  # armed afresh, and weighed first on the new engine


@pytest.mark.timeout(180)
def test_every_state_moves_once_the_first_plan_settled_where_the_host_held_the_workers(monkeypatch):
    """The first weighing declined; the workers waited for the host on the settled plan: every state moves before
    the next step, once, equal to the host's engine built again at the same batch."""
    weighs = ShareSwitch._fits_whole

    def declined_first(switch, engine, stretch=1.0):  # (on CPU workers the same plan fits beside them)
        return weighs(switch, engine, stretch) and stretch > 1.0

    monkeypatch.setattr(ShareSwitch, "_fits_whole", declined_first)
    halves = property(lambda engine: {"casts": 0.5 * (engine.caches.interval(ShareSwitch.intervals) or 0.0)})  # doubled
    monkeypatch.setattr(PipelineEngine, "worker_waits", halves)

    def run(callback: _Whole) -> tuple[L.LightningModule, RoundPipeStrategy]:
        strategy = RoundPipeStrategy()  # (the count chosen: periods simulated to compare)
        kwargs = {"accelerator": "cpu", "devices": 1, "max_epochs": 3, "callbacks": [callback], "strategy": strategy}
        return fit(lambda: BoringPipeline(depth=4), kwargs, boring_data(samples=192)), strategy

    events, builds = [], build.build_engine
    monkeypatch.setattr(WorkerDevice, "release_cached", lambda device: events.append("released"))
    monkeypatch.setattr(build, "build_engine", lambda *args: events.append("built") or builds(*args))
    moved = _Whole(1e6)
    module, strategy = run(moved)
    assert events == ["released", "built"]  # the old engine's cached blocks given back before the new one
    steps = [e[0] for e in moved.engines]
    assert len(steps) == 2 and steps[1] > 3 and moved.engines[1][2].whole  # not at the first plan (step 3)
    assert strategy._share.outcome["kept"] is True and strategy._share.outcome["share"] == 1.0
    assert strategy._share.weighed["stretch"] == pytest.approx(2.0) and strategy._share._whole is None
    monkeypatch.setattr(host_clock, "build_placed", _rebuilt_on_the_host)
    host = _Whole(1e6)
    reference, _ = run(host)
    assert [e[0] for e in host.engines] == steps
    assert relative_error(flat_weights(module), flat_weights(reference)) <= 1e-6


def test_the_log_line_says_every_state_may_move_later_where_they_would_fit(monkeypatch):
    store = HostStore([torch.nn.Linear(64, 64) for _ in range(4)], torch.bfloat16, separate_compute=True)
    engine, states = SimpleNamespace(store=store), resident_bytes(store)
    said = build._too_big(engine, [object()], 1.5 * states)  # over half of the limit, under STATES_MOST
    assert "are more than 50%" in said and "all of them move there once a plan beside them" in said
    assert "move there" not in build._too_big(engine, [object()], 1.1 * states)  # past STATES_MOST of it
    monkeypatch.setattr(ShareSwitch, "whole", False)
    assert "move there" not in build._too_big(engine, [object()], 1.5 * states)


def test_the_whole_move_is_armed_per_engine_only_where_switched_on(monkeypatch):
    switch = ShareSwitch()
    switch.watch(True)
    assert switch._whole == "first" and not switch.eligible  # on by default (the share's switch stays off)
    monkeypatch.setattr(ShareSwitch, "whole", False)
    switch.watch(True)
    assert not switch._whole
    monkeypatch.setattr(ShareSwitch, "whole", True)
    switch.watch(True)
    assert switch._whole
    switch.watch(False)  # several GPUs, a fixed plan, the states on the GPU already...
    assert not switch._whole


class _Weighs(L.Callback):
    """Weighs every state beside the plan mid-run, on a real planner (CPU workers: a limit set by hand)."""

    def __init__(self, factor: float) -> None:
        self.factor, self.unchanged, self.weighed, self.placed = factor, None, None, "not tried"

    def on_train_start(self, trainer, pl_module):
        engine = trainer.strategy.engine
        engine.planner.memory_limit = 1e6 * resident_bytes(engine.store)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        planner = trainer.strategy.engine.planner
        if trainer.global_step != 4:
            return
        names = ("plan", "microbatches_per_round", "candidate_periods", "memory_limit", "layer_costs")
        before = [getattr(planner, name) for name in (*names, "planned_elements", "memory_elements")]
        planner.memory_limit = self.factor * resident_bytes(trainer.strategy.engine.store)
        before[3] = planner.memory_limit
        switch = ShareSwitch()
        switch._fits_whole(trainer.strategy.engine)
        after = [getattr(planner, name) for name in (*names, "planned_elements", "memory_elements")]
        self.unchanged, self.weighed = after == before, switch.weighed
        if self.factor < 1 / STATES_MOST:  # the engine built with every state would refuse them: not built
            self.placed = build.build_placed(trainer.strategy.engine, _engine_arguments(trainer.strategy), "device")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("factor", [1e6, 1.3, 1.1])
def test_weighing_every_state_leaves_the_running_planner_as_it_was(factor):
    weighs = _Weighs(factor)
    kwargs = {"accelerator": "cpu", "devices": 1, "max_steps": 5, "callbacks": [weighs], "strategy": "roundpipe"}
    fit(lambda: BoringPipeline(depth=4), kwargs, boring_data(samples=192))
    assert weighs.unchanged is True
    assert weighs.weighed["as_fast"] is {1e6: True, 1.3: weighs.weighed["as_fast"], 1.1: False}[factor]
    assert weighs.placed is None if factor < 1 / STATES_MOST else weighs.placed == "not tried"


@pytest.mark.timeout(120)
def test_an_engine_built_again_elsewhere_during_the_trial_is_not_judged_as_the_share(monkeypatch):
    """A parameter frozen while the share is on trial: the engine built again for it is the default's (the host
    here), and the switch starts afresh on it instead of timing it as the share."""
    monkeypatch.setattr(CacheWatch, "gain", -1e9)
    _, engines, strategy = _run(0.5, freeze=True)
    assert len(engines) == 3 and engines[1][2] is not None and engines[2][2] is None
    assert strategy._share.outcome is None and strategy._share.share is None


def test_workers_waiting_for_the_host_offer_a_share_though_its_math_is_the_shorter():
    """On one H100 at 24 GiB AdamW's math (0.51 s) stayed under the GPU's compute while the worker waited 0.34 s a
    batch for the casts and updated weights: those waits offer the share, small ones do not."""
    store = HostStore([torch.nn.Linear(64, 64) for _ in range(4)], torch.bfloat16, separate_compute=True)
    engine = SimpleNamespace(
        store=store, caches=SimpleNamespace(ceiling=10 * resident_bytes(store)), stats=SimpleNamespace(compute_s=0.5)
    )
    switch = ShareSwitch()
    switch.automatic = True  # (off by default: see ShareSwitch.automatic)
    switch.watch(True)
    engine.worker_waits = {"update reads": 0.04, "casts": 0.03, "launch": 0.3}  # (launch: not the host's step)
    switch._offer_on_waits(engine)
    assert switch.share is None and switch.weighed == {"waited_s": pytest.approx(0.07), "compute_s": 0.5, "share": None}
    engine.worker_waits = {"update reads": 0.22, "casts": 0.12}
    switch._offer_on_waits(engine)
    assert switch.share == pytest.approx(1 - 0.8 * 0.5 / 0.84)
    assert switch.weighed["share"] == switch.share and switch.weighed["host_s"] == pytest.approx(0.84)
    assert switch.weighed["waited_s"] == pytest.approx(0.34)
    # under a limit whose half holds less than the deepest group's states: nothing moves, and the record says why
    small = ShareSwitch()
    small.automatic = True
    small.watch(True)
    engine.caches.ceiling = 0.3 * resident_bytes(store)  # share_for: 0.15, but whole groups hold 0.25
    small._offer_on_waits(engine)
    assert small.share is None and small.weighed["share"] is None
    assert small.weighed["held_gib"] > small.weighed["may_hold_gib"] > 0
    ineligible = ShareSwitch()  # (not "auto", several GPUs, a fixed plan...)
    ineligible._offer_on_waits(engine)
    assert ineligible.share is None


def test_the_switch_is_off_by_default():
    switch = ShareSwitch()
    switch.watch(True)
    assert not switch.eligible and not ShareSwitch.automatic


class _Clamp(L.Callback):
    """Weight clipping between steps, from step ``start`` on (a WGAN critic's, or a pruning mask's kind of edit)."""

    def __init__(self, start: int = 0, bound: float = 0.05, through: str = "no_grad") -> None:
        self.start, self.bound, self.through, self.places = start, bound, through, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.places.append(trainer.strategy.engine.resident is not None)
        if trainer.global_step >= self.start:
            with torch.no_grad():
                for p in pl_module.parameters():
                    (p.data if self.through == "data" else p).clamp_(-self.bound, self.bound)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("through", ["no_grad", "data"])
def test_auto_moves_the_states_to_the_host_once_the_weights_are_edited_between_steps(monkeypatch, through):
    """On the GPU the device's values replace an edit of the module's weights during training (the host's copy is
    up to one update behind them): where "auto" put the states there, the first edit moves them to the host, with
    one warning, and later edits take effect as with the states on the host from the start (that run's weights
    clamped the same from that step on); an explicit optimizer_on="device" keeps them there, warning. An edit
    through ``p.data`` moves no version counter: the host's sampled masters show it (it was dropped silently)."""
    from lightning_roundpipe.engine import pipeline

    placed = pipeline.place_states
    monkeypatch.setattr(pipeline, "place_states", lambda on, *args: placed("device" if on == "auto" else on, *args))
    runs = {}
    for place in ("auto", "host", "device"):
        clamp = _Clamp(start=3, through=through)
        strategy = RoundPipeStrategy(num_microbatches=2, optimizer_on=place)
        kwargs = {"accelerator": "cpu", "devices": 1, "max_epochs": 2, "callbacks": [clamp], "strategy": strategy}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runs[place] = flat_weights(fit(BoringPipeline, kwargs))
        said = [str(w.message) for w in caught if "edited during training" in str(w.message)]
        replaced = [str(w.message) for w in caught if "changed on the host during training" in str(w.message)]
        if place == "auto":
            assert len(said) == 1 and not replaced and "this one was replaced" in said[0]
            assert clamp.places[:3] == [True] * 3 and not any(clamp.places[3:])  # clamped after the third, moved
            assert strategy._share.outcome["edited"] is True
            assert strategy.options.optimizer_on == "host"  # (an engine built again later: on the host too)
        else:
            assert not said and (bool(replaced) is (place == "device"))
    assert runs["auto"].abs().max() <= 1.5 * runs["host"].abs().max() < 0.1  # clamped, to one update after it
    assert runs["device"].abs().max() > 2 * runs["host"].abs().max()  # the device's values kept
