"""The caching-allocator watch: a plan whose batches keep making a device free cached memory (a device-wide
wait each time) is planned again for less memory, and training stays exact through the change."""

from __future__ import annotations

import copy

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


class Planner:
    """What the watch reads of the planner: the first call of the current plan, whether it measures."""

    plan_since = 0
    measuring = False


def looks(watch: CacheWatch, calls: range, plan_since: int = 0, measuring: bool = False) -> list[bool]:
    return [watch.stalls(call, plan_since, measuring) for call in calls]


def test_the_watch_waits_for_the_plan_to_settle_then_for_frees_in_a_row():
    device = Freeing("cpu")
    watch = CacheWatch([device], Planner(), None)  # type: ignore[arg-type]
    # calls 0-1 settle the plan; from call 2 on every interval freed: the second in a row stalls
    assert looks(watch, range(5)) == [False, False, False, True, False]
    assert looks(watch, range(5, 7)) == [True, False]
    device.freeing = False
    assert looks(watch, range(7, 12)) == [False] * 5
    device.freeing = True
    assert looks(watch, range(12, 16), measuring=True) == [False] * 4  # measuring batches are not judged
    assert looks(watch, range(16, 19), plan_since=16) == [False, False, False]  # a new plan settles first
    watch.forget()  # an evaluation pass ran: the next interval is not judged
    assert looks(watch, range(19, 22), plan_since=16) == [False, False, True]
    watch.lowered = CacheWatch.limit
    assert looks(watch, range(22, 26), plan_since=16) == [False] * 4


@pytest.mark.timeout(120)
def test_frees_every_batch_plan_smaller_stages_and_training_stays_exact():
    _SLOW.update(layer=-1)
    net = model()
    reference = copy.deepcopy(net)
    workers = [Freeing("cpu", i) for i in range(2)]
    for w in workers:
        w.freeing = False
    engine = auto_engine(net, check_every=0, memory_limit=1e12)
    engine.caches.devices = workers  # the engine's own CPU workers free nothing
    try:
        train_and_compare(engine, net, reference, 1)  # the measuring batch
        costs = engine.planner.layer_costs
        assert costs is not None
        first = engine.plan
        need = max(stage_memory(costs, stage) for stage in first.stages())
        engine.planner.memory_limit = need  # the plan just fits the planner's model
        train_and_compare(engine, net, reference, 4)
        assert engine.plan == first and engine.planner.memory_limit == need  # no frees: nothing changes
        for w in workers:
            w.freeing = True
        with pytest.warns(UserWarning, match="gave device memory back in each of the last 2 batches") as caught:
            train_and_compare(engine, net, reference, 3)
        assert "Planning for" in str(caught[0].message)
        assert engine.planner.memory_limit == pytest.approx(CacheWatch.factor * need)
        assert engine.plan != first
        assert all(stage_memory(costs, s) <= CacheWatch.factor * need for s in engine.plan.stages())
        for w in workers:
            w.freeing = False
        train_and_compare(engine, net, reference, 4)  # the same numbers under the smaller plan
        assert engine.caches.lowered == 1
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
            train_and_compare(engine, net, reference, 8)
        assert len([w for w in caught if "gave device memory back" in str(w.message)]) == 1  # said once
        assert "gpu_memory" in str(caught[0].message)
        assert str(engine.plan) == "4|4,4" and engine.planner.memory_limit == 1e12
    finally:
        engine.close()
