"""Of the partitioner's near-optimal plans, the one the simulator finds fastest.

The partitioner minimises the paper's objective ``(M * S + N * (N - 1)) * t_max``, a proxy for the
iteration time. The proxy misses what the simulator models: a larger fused stage recomputes less, and
stages of unequal time leave workers waiting depending on where they fall in the round-robin order.
On the Llama-8B-shaped costs measured on an H200 (8 workers, 16 micro-batches) the plan with the best
objective was 12% slower per iteration (the other plan's period 11% shorter) than a plan within 8% of
that objective. :func:`fastest_plan` simulates the best plan of each stage count near the optimum (a
few milliseconds each) and keeps the one with the shortest steady-state iteration; the objective's own
plan is always among them. :func:`automatic_plan` is what the engine calls: ``planner="fastest"`` (the
default) takes this one, ``"objective"`` :func:`partition`'s. Measured on 2 H200s (Qwen3-1.7B shape,
64 x 2048 tokens in 16 micro-batches): the fastest plan ``17|13,17`` ran 49.5k tokens/s, the
objective's ``23|7,11,12`` 45.0k (means of the last 10 of 20 steps).
"""

from __future__ import annotations

from lightning_roundpipe.schedule.partition import LayerCosts, Partition, near_optimal, partition
from lightning_roundpipe.schedule.simulate import roundpipe

PLANNERS = ("objective", "fastest")


def fastest_plan(
    costs: LayerCosts,
    workers: int,
    microbatches: int,
    memory_limit: float | None = None,
    asynchronous: bool = True,
    handoff: float = 0.0,
    within: float = 0.15,
) -> Partition:
    """The plan with the shortest simulated iteration among :func:`near_optimal`'s (ties: the better
    objective). Raises :class:`~lightning_roundpipe.schedule.partition.Infeasible` like the partitioner."""
    candidates = near_optimal(costs, workers, microbatches, memory_limit, within)
    if len(candidates) == 1:
        return candidates[0]

    def period(candidate: Partition) -> float:
        return roundpipe(
            costs, candidate.plan, workers, microbatches, asynchronous=asynchronous, handoff=handoff
        ).period

    return min(candidates, key=lambda c: (period(c), c.objective))


def automatic_plan(
    costs: LayerCosts,
    workers: int,
    microbatches: int,
    memory_limit: float | None = None,
    planner: str = "fastest",
    asynchronous: bool = True,
) -> Partition:
    """The plan an automatic engine switches to: the objective's optimum, or the fastest simulated."""
    if planner == "fastest":
        return fastest_plan(costs, workers, microbatches, memory_limit, asynchronous=asynchronous)
    if planner == "objective":
        return partition(costs, workers, microbatches, memory_limit)
    raise ValueError(f"planner={planner!r} is not one of {PLANNERS}")
