"""The partitioner finds the optimal plan (checked against brute force) and respects memory limits."""

from __future__ import annotations

import random

import pytest

from lightning_roundpipe.schedule.partition import Infeasible, LayerCosts, brute_force, objective, partition


def random_costs(rng: random.Random, layers: int) -> LayerCosts:
    forward = tuple(round(rng.uniform(0.2, 3.0), 2) for _ in range(layers))
    backward = tuple(round(f * rng.uniform(2.0, 3.5), 2) for f in forward)
    params = tuple(rng.randint(1, 8) for _ in range(layers))
    return LayerCosts(
        forward, backward, params, params,
        tuple(rng.randint(0, 4) for _ in range(layers)), tuple(rng.randint(1, 6) for _ in range(layers)),
        tuple(rng.choice([0, 0, rng.randint(1, 12)]) for _ in range(layers)),
    )  # fmt: skip


def stage_memory_ok(costs: LayerCosts, result, limit: float) -> bool:
    plan = result.plan
    for stage in plan.stages():
        a, b = stage.start, stage.stop
        if stage.kind.value == "F":
            need = 2 * sum(costs.params[a:b]) + max(costs.forward_activations[a:b])
        else:
            need = 2 * sum(costs.params[a:b]) + 2 * sum(costs.grads[a:b]) + sum(costs.backward_activations[a:b])
            need += max(costs.backward_transients[a:b])
        if need > limit:
            return False
    return True


def test_matches_brute_force_on_random_instances():
    rng = random.Random(0)
    checked = 0
    for _ in range(300):
        layers = rng.randint(1, 9)
        costs = random_costs(rng, layers)
        workers = rng.randint(1, 8)
        microbatches = rng.randint(workers, 3 * workers)
        limit = rng.choice([None, rng.uniform(20, 120)])
        want = brute_force(costs, workers, microbatches, limit)
        if want == float("inf"):
            with pytest.raises(Infeasible):
                partition(costs, workers, microbatches, limit)
            continue
        got = partition(costs, workers, microbatches, limit)
        got.plan.check_layers(layers)
        assert got.objective == pytest.approx(want, rel=1e-9), (costs, workers, microbatches, limit, got)
        assert stage_memory_ok(costs, got, float("inf") if limit is None else limit)
        times = [
            sum((costs.forward if s.kind.value == "F" else costs.backward)[s.start : s.stop]) for s in got.plan.stages()
        ]
        assert max(times) == pytest.approx(got.t_max)
        checked += 1
    assert checked > 200


def test_uniform_layers_balance_three_forward_layers_per_backward_one():
    costs = LayerCosts((1.0,) * 12, (3.0,) * 12)
    got = partition(costs, workers=4, microbatches=8)
    assert got.t_max == 3.0
    # three forward layers per one-layer backward stage; the fused stage holds what fits in t_max (one layer)
    assert str(got.plan) == "3,3,3,2|1,1,1,1,1,1,1,1,1,1,1,1"


def test_a_layer_too_large_for_the_limit_is_a_clear_error():
    costs = LayerCosts((1.0, 1.0), (3.0, 3.0), params=(2 * 2**30, 10 * 2**30), grads=(2 * 2**30, 10 * 2**30))
    want = r"layer 1 needs 40.00 GiB .* the limit is 24.00 GiB.*split_decoder_layers=True"
    with pytest.raises(Infeasible, match=want):
        partition(costs, workers=2, microbatches=4, memory_limit=24 * 2**30)


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="backward has 2 entries for 3 layers"):
        LayerCosts((1.0, 1.0, 1.0), (1.0, 1.0))


def test_objective_formula():
    assert objective(num_slots=10, t_max=2.0, microbatches=8, workers=4) == (8 * 10 + 4 * 3) * 2.0


def test_every_worker_gets_a_slot_when_layers_allow():
    costs = LayerCosts((0.1,) * 8, (0.3,) * 7 + (3.0,))  # one fused stage could hold everything
    got = partition(costs, workers=4, microbatches=8)
    assert got.plan.num_slots >= 4


def test_backward_transients_count_once_per_stage_and_shrink_stages_near_the_limit():
    # a heavy last layer (the LM head) sets t_max, so the other layers pack into large stages
    base = dict(params=(1,) * 4, grads=(1,) * 4, backward_activations=(10,) * 4)
    lean = LayerCosts((0.5,) * 4, (1.0, 1.0, 1.0, 6.0), **base)
    heavy = LayerCosts((0.5,) * 4, (1.0, 1.0, 1.0, 6.0), **base, backward_transients=(9,) * 4)

    def widest(plan):
        return max(s.stop - s.start for s in plan.stages() if s.kind.value == "B")

    assert widest(partition(lean, 2, 2, 45).plan) == 3  # 2 * 6 + 30 = 42
    assert widest(partition(heavy, 2, 2, 45).plan) == 2  # 42 + 9 > 45; two layers: 8 + 20 + 9 = 37 (not 46)
    assert widest(partition(heavy, 2, 2, 36).plan) == 1  # 37 > 36
    with pytest.raises(Infeasible, match="transient"):
        partition(heavy, 2, 2, 20)  # one layer alone: 4 + 10 + 9 = 23
