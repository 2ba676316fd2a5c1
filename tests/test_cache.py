"""The caching-allocator watch: a plan whose batches keep making a device free cached memory (a device-wide
wait each time) is planned again for less memory on trial, kept only when its batches are faster, and
training stays exact through every change."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from test_autoplan import _SLOW, MeteredDevice, auto_engine, model, train_and_compare

from lightning_roundpipe.engine import PipelineEngine
from lightning_roundpipe.engine.cache import CacheWatch
from lightning_roundpipe.schedule.partition import stage_memory


class Freeing(MeteredDevice):
    """A CPU worker whose allocator, while ``freeing``, gave memory back since every previous look."""

    freeing = True

    def cache_releases(self) -> int:
        if self.freeing:
            self.released += 1
        return self.released


class Clock:
    """Time that moves by the running plan's seconds per batch at each look (one look per dispatch)."""

    def __init__(self, pace):
        self.now, self.pace = 0.0, pace

    def __call__(self) -> float:
        self.now += self.pace()
        return self.now


class Planner:
    """What the watch uses of the planner; ``plans`` maps a memory limit to the plan chosen from it on."""

    def __init__(self, plans: dict[float, str], limit: float = 8.0) -> None:
        self.plans, self.memory_limit = plans, limit
        self.plan, self.plan_since, self.measuring, self.microbatches_per_round = plans[limit], 0, False, 2
        self.candidate_periods = self.layer_costs = self.planned_elements = self.memory_elements = None

    def plan_for_memory(self, store, limit: float) -> str | None:
        fits = [k for k in self.plans if k <= limit + 1e-9]
        if not fits:
            return None
        self.memory_limit = limit
        return self.plans[max(fits)]


def watch_for(plans: dict[float, str], seconds: dict[str, float]) -> tuple[CacheWatch, Planner, Freeing]:
    device, planner = Freeing("cpu"), Planner(plans)
    return CacheWatch([device], planner, None, Clock(lambda: seconds[planner.plan])), planner, device  # type: ignore[arg-type]


def drive(watch: CacheWatch, planner: Planner, calls: range) -> list[tuple[int, str]]:
    """Dispatch ``calls`` as the engine does (a returned plan runs from that call on): the switches."""
    switched = []
    for call in calls:
        if (plan := watch.next_plan(call, 8)) is not None:
            planner.plan, planner.plan_since = plan, call
            switched.append((call, plan))
    return switched


def test_a_faster_smaller_plan_is_kept_after_both_are_timed():
    watch, planner, device = watch_for({8.0: "A", 6.0: "B"}, {"A": 1.0, "B": 0.8})
    # calls 0-1 settle; 2-6 make the window of four intervals, each freeing: B on trial from call 6
    assert drive(watch, planner, range(6)) == []
    assert drive(watch, planner, range(6, 7)) == [(6, "B")]
    assert drive(watch, planner, range(7, 13)) == [(12, "A")]  # B timed over calls 8-12; A again, timed after
    with pytest.warns(UserWarning, match="faster per token: kept") as caught:
        assert drive(watch, planner, range(13, 19)) == [(18, "B")]  # 20% faster than A over calls 14-18
    assert "20% faster" in str(caught[0].message)
    assert (watch.lowered, watch.reverted, planner.memory_limit) == (1, False, 6.0)
    (trial,) = watch.trials  # what a benchmark records: both plans' seconds per sample
    assert trial["kept"] and trial["tried_s"] == pytest.approx(0.8 * trial["before_s"])
    device.freeing = False
    assert drive(watch, planner, range(19, 40)) == []


def test_a_settled_plan_gives_its_wall_seconds_a_batch_and_none_on_trial():
    """What ShareSwitch stretches by the host's waits: the mean interval between dispatches over the pace's window,
    only where the pace is given: settled, not on trial, and not from a dispatch that switched plans (its window
    still holds the old plan's batches)."""
    watch, planner, device = watch_for({8.0: "A"}, {"A": 1.25})
    device.freeing = False
    drive(watch, planner, range(6))
    assert watch.interval() is None and watch.pace() is None  # calls 0-1 settle; four intervals from call 6
    assert watch.interval(2) == pytest.approx(1.25)  # two intervals from call 4 (what the whole move weighs)
    drive(watch, planner, range(6, 7))
    assert watch.interval() == pytest.approx(1.25) and watch.pace() == pytest.approx(1.25 / 8)
    assert watch.interval(CacheWatch.window + 1) is None  # more intervals than the times kept

    watch, planner, device = watch_for({8.0: "A", 6.0: "B"}, {"A": 1.0, "B": 0.8})
    assert drive(watch, planner, range(6)) == [] and watch.interval() is None
    assert drive(watch, planner, range(6, 7)) == [(6, "B")] and watch.interval() is None  # A's window, B on trial
    with pytest.warns(UserWarning, match="kept"):
        assert drive(watch, planner, range(7, 19)) == [(12, "A"), (18, "B")]
    assert watch.interval() is None  # kept at call 18's dispatch: the window holds A's batches
    device.freeing = False
    drive(watch, planner, range(19, 25))
    assert watch.interval() == pytest.approx(0.8)


def test_a_smaller_plan_that_is_not_faster_is_left_and_the_watch_stops():
    watch, planner, _ = watch_for({8.0: "A", 6.0: "B"}, {"A": 1.0, "B": 0.99})  # 1% is timing noise
    assert drive(watch, planner, range(13)) == [(6, "B"), (12, "A")]
    with pytest.warns(UserWarning, match="were not faster") as caught:
        assert drive(watch, planner, range(13, 19)) == []
    assert "the plan for 0.0 GiB stays" in str(caught[0].message)  # (the fake's limits are a few bytes)
    assert (watch.lowered, watch.reverted, watch.stopped, planner.memory_limit) == (0, True, True, 8.0)
    assert [t["kept"] for t in watch.trials] == [False]
    assert drive(watch, planner, range(19, 50)) == []  # still freeing: nothing more is tried


def test_the_plan_timed_first_is_not_favoured_by_a_run_that_speeds_up():
    watch, planner, _ = watch_for({8.0: "A", 6.0: "B"}, {})
    slow_start = iter([2.0] * 12 + [1.0] * 100)  # the first batches are slow whatever the plan
    watch.clock = Clock(lambda: next(slow_start))
    with pytest.warns(UserWarning, match="were not faster"):
        assert drive(watch, planner, range(30)) == [(6, "B"), (12, "A")]
    assert planner.memory_limit == 8.0


def test_a_limit_that_chooses_the_same_plan_is_passed_over():
    watch, planner, _ = watch_for({8.0: "A", 6.0: "A", 4.5: "C"}, {"A": 1.0, "C": 0.5})
    with pytest.warns(UserWarning, match="kept"):
        assert drive(watch, planner, range(19)) == [(6, "C"), (12, "A"), (18, "C")]  # 6.0 chose A again
    assert (watch.lowered, planner.memory_limit) == (2, 4.5)
    assert drive(watch, planner, range(19, 40)) == []  # 3.4 fits nothing: the limit stays, nothing more tried
    assert (watch.stopped, planner.memory_limit) == (True, 4.5)


class Simulating(Planner):
    """A planner whose every choice leaves what it simulated (as the real one's candidate periods)."""

    def plan_for_memory(self, store, limit: float) -> str | None:
        self.candidate_periods = {"simulated under": limit}
        return super().plan_for_memory(store, limit)


def test_lower_limits_that_choose_the_same_plan_leave_the_planner_as_it_runs():
    """Nothing differs under a lower limit: the planner is put back as it was, not chosen again under the old limit
    (the shapes it would choose from have moved since the running plan was chosen)."""
    device, planner = Freeing("cpu"), Simulating({8.0: "A", 6.0: "A", 4.5: "A"})
    planner.candidate_periods = {"running": 1.0}
    watch = CacheWatch([device], planner, None, Clock(lambda: 1.0))  # type: ignore[arg-type]
    with pytest.warns(UserWarning, match="The plan stays"):
        assert drive(watch, planner, range(30)) == []
    assert (planner.candidate_periods, planner.memory_limit, watch.stopped) == ({"running": 1.0}, 8.0, True)


def test_frees_without_a_smaller_plan_warn_once_and_the_limit_stays():
    watch, planner, _ = watch_for({8.0: "A"}, {"A": 1.0})
    with pytest.warns(UserWarning, match="The plan stays") as caught:
        assert drive(watch, planner, range(30)) == []
    assert len(caught) == 1 and "gpu_memory" in str(caught[0].message)
    assert (planner.memory_limit, watch.stopped) == (8.0, True)


def test_measuring_evaluation_and_quiet_batches_are_not_judged():
    watch, planner, device = watch_for({8.0: "A", 6.0: "B"}, {"A": 1.0, "B": 0.5})
    device.freeing = False
    assert drive(watch, planner, range(20)) == []
    device.freeing = True
    for call in range(20, 30):  # an evaluation pass between every two batches: no interval is judged
        watch.forget()
        assert watch.next_plan(call, 8) is None
    planner.measuring = True
    assert drive(watch, planner, range(30, 40)) == []
    planner.measuring = False
    planner.plan_since = 40
    assert drive(watch, planner, range(40, 47)) == [(46, "B")]
    planner.measuring = True  # the planner measures the layers again mid-trial: its limit comes back
    assert drive(watch, planner, range(47, 48)) == [] and planner.memory_limit == 8.0
    planner.measuring = False  # (the planner's next plan comes from its own measurement, under 8.0)


def exact_engine_through_a_trial(pace_of_first: float, pace_of_smaller: float):
    """A two-worker engine whose measured plan just fits its limit while its allocators free every batch,
    timed by a clock that gives the first plan and the smaller one these seconds per batch; gradients
    are compared with plain autograd after every batch. Returns the engine, the first plan and its limit."""
    _SLOW.update(layer=-1)
    net = model()
    reference = copy.deepcopy(net)
    workers = [Freeing("cpu", i) for i in range(2)]
    for w in workers:
        w.freeing = False
    engine = auto_engine(net, check_every=0, memory_limit=1e12)
    try:
        return through_a_trial(engine, workers, net, reference, pace_of_first, pace_of_smaller)
    except BaseException:
        engine.close()  # a failed check must not leave worker threads behind for the tests after it
        raise


class EvenTimes:
    """A measured profile with every layer's seconds made equal, so that the plans depend on memory only,
    which is exact: CPU timings taken on a loaded machine once chose a first plan with nothing smaller."""

    def __init__(self, profile) -> None:
        self.profile = profile

    def costs(self, *args, **kwargs):
        costs = self.profile.costs(*args, **kwargs)
        n = len(costs.forward)
        return dataclasses.replace(costs, forward=(1e-3,) * n, backward=(3e-3,) * n)

    def __getattr__(self, name: str):
        return getattr(self.profile, name)


def through_a_trial(engine: PipelineEngine, workers, net, reference, pace_of_first: float, pace_of_smaller: float):
    engine.caches.devices = workers  # the engine's own CPU workers free nothing
    train_and_compare(engine, net, reference, 1)  # the measuring batch
    engine.planner.fitted = EvenTimes(engine.planner.fitted)
    unlimited = engine.planner.plan_for_memory(engine.store, 1e12)
    costs = engine.planner.layer_costs
    assert unlimited is not None and costs is not None
    need = max(stage_memory(costs, stage) for stage in unlimited.stages())
    first = engine.planner.plan_for_memory(engine.store, need)  # the plan for a limit it just fits, as a run
    assert first is not None  # that began under that limit would have chosen it
    engine.planner.set_plan(first, engine.calls)
    engine.caches.clock = Clock(lambda: pace_of_first if engine.plan == first else pace_of_smaller)
    train_and_compare(engine, net, reference, 8)
    assert engine.plan == first and engine.planner.memory_limit == need  # no frees: nothing changes
    for w in workers:
        w.freeing = True
    train_and_compare(engine, net, reference, 7)  # the window of frees: a smaller plan on trial, timed
    assert engine.plan != first and engine.planner.memory_limit < need
    assert all(stage_memory(costs, s) <= engine.planner.memory_limit for s in engine.plan.stages())
    saved = engine.state_dict()  # a checkpoint mid-trial keeps the plan the run settled on, not the one on trial
    assert (saved["plan"], saved["memory_limit"], saved["drift_reference"]) == (str(first), need, None)
    train_and_compare(engine, net, reference, 6)  # the first plan again, timed after it
    assert engine.plan == first and engine.planner.memory_limit == need
    return engine, net, reference, first, need


@pytest.mark.timeout(120)
def test_a_faster_smaller_plan_trains_exactly_and_stays():
    engine, net, reference, first, need = exact_engine_through_a_trial(1.0, 0.7)
    try:
        for w in engine.caches.devices:
            w.freeing = False  # the smaller plan's caches fit: after it is kept, nothing more is tried
        with pytest.warns(UserWarning, match="kept"):
            train_and_compare(engine, net, reference, 6)  # judged on the first plan: the smaller one kept
        assert engine.plan != first and engine.caches.lowered >= 1 and not engine.caches.reverted
        assert engine.planner.memory_limit == pytest.approx(CacheWatch.factor**engine.caches.lowered * need)
        saved = engine.state_dict()
        assert (saved["plan"], saved["memory_limit"]) == (str(engine.plan), engine.planner.memory_limit)
    finally:
        engine.close()


@pytest.mark.timeout(120)
def test_a_slower_smaller_plan_is_undone_and_training_stays_exact():
    engine, net, reference, first, need = exact_engine_through_a_trial(1.0, 1.2)
    try:
        with pytest.warns(UserWarning, match="were not faster"):
            train_and_compare(engine, net, reference, 6)
        assert engine.plan == first and engine.planner.memory_limit == need and engine.caches.reverted
        train_and_compare(engine, net, reference, 8)  # frees go on; the first plan stays
        assert engine.plan == first
    finally:
        engine.close()


@pytest.mark.timeout(120)
def test_a_fixed_plan_is_kept_and_the_warning_says_what_to_change():
    net = model()
    reference = copy.deepcopy(net)
    workers = [Freeing("cpu", i) for i in range(2)]
    engine = PipelineEngine(list(net.children()), workers, plan="4|4,4", microbatches_per_round=2, memory_limit=1e12)
    try:
        with pytest.warns(UserWarning, match="The plan stays") as caught:
            train_and_compare(engine, net, reference, 10)
        assert len([w for w in caught if "gave device memory back" in str(w.message)]) == 1  # said once
        assert "gpu_memory" in str(caught[0].message)
        assert str(engine.plan) == "4|4,4" and engine.planner.memory_limit == 1e12
    finally:
        engine.close()


class Holding(Freeing):
    """A CPU worker whose allocator holds ``held`` bytes after each batch; a release frees 5 cached blocks."""

    freeing = False

    def release_cached(self) -> None:
        self.released += 5
        self.held = 0


def test_a_cache_held_above_the_users_limit_is_given_back_and_its_frees_are_not_the_plans_pressure():
    device, planner = Holding("cpu"), Planner({8.0: "A", 6.0: "B"})
    watch = CacheWatch([device], planner, None, Clock(lambda: 1.0))  # type: ignore[arg-type]
    for call in range(12):
        device.held = 9  # above the 8 bytes allowed, after every batch
        assert watch.next_plan(call, 8) is None  # its own frees (5 a release) never start a trial
        assert device.held == 0
    assert (watch.releases, device.released, watch.trials, watch.stopped) == (12, 60, [], False)
    device.freeing = True  # frees of the plan's own (one per look) still count: two intervals of them start a trial
    assert drive(watch, planner, range(12, 14)) == [(13, "B")]
    device.held = 7  # a trial's lower limit (6) is not what the user allowed: nothing is given back under 8
    assert watch.next_plan(14, 8) is None
    assert (planner.memory_limit, watch.ceiling, device.held, watch.releases) == (6.0, 8.0, 7, 12)
