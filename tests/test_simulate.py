"""The pipeline simulator on hand-checkable cases, and its bubble breakdown."""

from __future__ import annotations

import json

import pytest

from lightning_roundpipe.schedule.partition import LayerCosts, partition
from lightning_roundpipe.schedule.plan import StagePlan
from lightning_roundpipe.schedule.simulate import SCHEDULES, bubbles, roundpipe, simulate

UNIFORM = LayerCosts((1.0,) * 8, (3.0,) * 8)


@pytest.mark.parametrize(("workers", "microbatches"), [(2, 4), (4, 8), (4, 16), (8, 16)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_is_n_minus_one_over_m_plus_n_minus_one(schedule, workers, microbatches):
    t = simulate(schedule, UNIFORM, workers, microbatches, iterations=3)
    assert t.bubble_ratio == pytest.approx((workers - 1) / (microbatches + workers - 1))


@pytest.mark.parametrize(("workers", "microbatches"), [(2, 4), (4, 8), (4, 12)])
@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "looped-bfs"])
def test_looped_schedules_divide_the_bubble_by_the_chunks(schedule, workers, microbatches):
    t = simulate(schedule, UNIFORM, workers, microbatches, chunks=2, iterations=3)
    assert t.bubble_ratio == pytest.approx((workers - 1) / (2 * microbatches + workers - 1))


@pytest.mark.parametrize(("workers", "microbatches"), [(2, 4), (4, 4), (4, 8), (4, 16), (8, 16)])
def test_roundpipe_sync_bubble_is_the_papers_formula_and_async_removes_it(workers, microbatches):
    plan = StagePlan.parse("3,3,3,2|1,1,1,1,1,1,1,1,1,1,1,1")  # 16 slots, a multiple of the workers
    costs = LayerCosts((1.0,) * 12, (3.0,) * 12)
    s = plan.num_slots
    even = [3.0] * s
    sync = roundpipe(costs, plan, workers, microbatches, iterations=4, asynchronous=False, slot_times=even)
    assert sync.bubble_ratio == pytest.approx(workers * (workers - 1) / (microbatches * s + workers * (workers - 1)))
    flowing = roundpipe(costs, plan, workers, microbatches, iterations=4, asynchronous=True, slot_times=even)
    assert flowing.bubble_ratio == pytest.approx(0.0, abs=1e-12)


def test_breakdown_separates_imbalance_from_structure():
    heavy_head = LayerCosts((1.0,) * 15 + (6.0,), (3.0,) * 15 + (18.0,))  # an LM head six layers heavy
    plan = partition(heavy_head, workers=4, microbatches=16).plan
    for schedule in SCHEDULES:
        b = bubbles(schedule, heavy_head, 4, 16, plan=plan)
        assert b.total == pytest.approx(b.imbalance + b.structural)
        assert 0 <= b.total < 1
    gpipe = bubbles("gpipe", heavy_head, 4, 16)
    assert gpipe.imbalance > 0.05  # the head's stage holds everybody up
    rp = bubbles("roundpipe-async", heavy_head, 4, 16, plan=plan)
    assert rp.total < gpipe.total and rp.structural == pytest.approx(0.0, abs=1e-9)


def test_chrome_trace_has_every_task():
    t = simulate("1f1b", UNIFORM, 2, 4, iterations=1)
    trace = json.loads(json.dumps(t.chrome_trace()))
    assert len(trace["traceEvents"]) == len(t.tasks) == 2 * 2 * 4
    assert {e["tid"] for e in trace["traceEvents"]} == {0, 1}


def test_roundpipe_needs_a_plan_and_interleaving_needs_whole_groups():
    with pytest.raises(ValueError, match="needs a stage plan"):
        simulate("roundpipe-async", UNIFORM, 2, 4)
    with pytest.raises(ValueError, match="multiples of workers"):
        simulate("interleaved-1f1b", UNIFORM, 4, 6)


def test_bubble_ratio_stays_between_zero_and_one_when_iterations_overlap():
    """Asynchronous iterations overlap; whole iterations' work over a window between iteration ends can
    exceed what fits there (the engine once reported -4%). Only the work done inside counts."""
    import random

    rng = random.Random(0)
    for _ in range(200):
        layers = rng.randint(3, 10)
        costs = LayerCosts(
            tuple(rng.uniform(0.1, 2.0) for _ in range(layers)), tuple(rng.uniform(0.2, 6.0) for _ in range(layers))
        )
        workers = rng.randint(1, 4)
        microbatches = rng.randint(workers, 2 * workers + 2)
        plan = partition(costs, workers, microbatches).plan
        for schedule in ("roundpipe-async", "roundpipe-sync"):
            ratio = simulate(schedule, costs, workers, microbatches, plan=plan).bubble_ratio
            assert 0.0 <= ratio < 1.0, (schedule, costs, workers, microbatches, str(plan), ratio)


@pytest.mark.parametrize("microbatches", [1, 4])
def test_handoff_with_everything_fused_shows_after_the_batch_or_behind_its_last_backward(microbatches):
    """One worker, everything in the fused stage. Synchronously the next batch's first slot waits for
    this batch to settle plus the handoff (the host's turn and the first slot's upload). Asynchronously
    the last loss reaches the host before that slot's backward (8 of its 12 s here), which hides a
    handoff up to that long; only the rest shows."""
    costs = LayerCosts((1.0,) * 4, (3.0,) * 4)
    plan = StagePlan.parse("|4")
    work = microbatches * 12.0
    t = simulate("roundpipe-sync", costs, 1, microbatches, plan=plan, iterations=5, handoff=2.0)
    assert t.period == pytest.approx(work + 2.0)
    assert t.bubble_ratio == pytest.approx(2.0 / (work + 2.0))
    assert simulate("roundpipe-async", costs, 1, microbatches, plan=plan, iterations=5, handoff=2.0).period == (
        pytest.approx(work)
    )
    t = simulate("roundpipe-async", costs, 1, microbatches, plan=plan, iterations=5, handoff=10.0)
    assert t.period == pytest.approx(work + 2.0)
    for schedule in ("roundpipe-async", "roundpipe-sync"):
        assert simulate(schedule, costs, 1, microbatches, plan=plan, iterations=5).bubble_ratio == pytest.approx(0.0)


def test_handoff_hides_behind_the_slots_after_the_fused_stage():
    """Two workers: the backward slots after the fused stage keep both busy while the next batch is
    handed over, as long as the handoff is shorter than them; a longer one shows."""
    costs = LayerCosts((1.0,) * 8, (3.0,) * 8)
    plan = StagePlan.parse("2,2,2|2,1,1,1,1,1,1")
    base = simulate("roundpipe-async", costs, 2, 4, plan=plan, iterations=6).bubble_ratio
    short = simulate("roundpipe-async", costs, 2, 4, plan=plan, iterations=6, handoff=1.0).bubble_ratio
    long = simulate("roundpipe-async", costs, 2, 4, plan=plan, iterations=6, handoff=60.0).bubble_ratio
    assert short == pytest.approx(base, abs=1e-9)
    assert long > base + 0.05
