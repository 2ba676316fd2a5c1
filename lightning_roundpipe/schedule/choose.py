"""Of the partitioner's near-optimal plans, the one the simulator finds fastest.

The partitioner minimises the paper's objective ``(M * S + N * (N - 1)) * t_max``, a proxy for the
iteration time. The proxy misses what the simulator models: a larger fused stage recomputes less, and
stages of unequal time leave workers waiting depending on where they fall in the round-robin order.
On the Llama-8B-shaped costs measured on an H200 (8 workers, 16 micro-batches) the plan with the best
objective was 12% slower per iteration (the other plan's period 11% shorter) than a plan within 8% of
that objective. :func:`fastest_plan` simulates the best plan of each stage count near the optimum (a
few milliseconds each), also under tighter memory limits (:data:`TIGHTER`), and keeps the one with the
shortest steady-state iteration; the objective's own plan is always among them. :func:`automatic_plan`
is what the engine calls: ``planner="fastest"`` (the default) takes this one, ``"objective"``
:func:`partition`'s. Measured on 2 H200s (Qwen3-1.7B shape, 64 x 2048 tokens in 16 micro-batches): the
fastest plan ``17|13,17`` ran 49.5k tokens/s, the objective's ``23|7,11,12`` 45.0k (means of the last
10 of 20 steps).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lightning_roundpipe.schedule.partition import (
    Infeasible,
    LayerCosts,
    Partition,
    near_optimal,
    partition,
    stage_times,
)
from lightning_roundpipe.schedule.plan import StagePlan
from lightning_roundpipe.schedule.simulate import roundpipe

PLANNERS = ("objective", "fastest")


TIGHTER = (0.75, 0.5625)
"""Memory limits, as shares of the one given, whose near-optimal plans are simulated too. They fit the
given limit, and the objective does not see what their smaller stages may gain (more compute to hide each
stage's upload behind): on one H200 capped at 24 GiB (Qwen3-1.7B shape, 2 micro-batches) the plan chosen
under 19.2 GiB simulated 1.510 s per batch, the one chosen under 14.4 GiB 1.434 s (and ran 1.04x it,
the first plan's allocator frees included)."""


def candidates(
    costs: LayerCosts, workers: int, microbatches: int, memory_limit: float | None = None, within: float = 0.15
) -> list[Partition]:
    """:func:`near_optimal`'s plans under ``memory_limit`` and under the :data:`TIGHTER` shares of it (the
    first are the given limit's, best objective first). Raises ``Infeasible`` when none fits."""
    found = {str(c.plan): c for c in near_optimal(costs, workers, microbatches, memory_limit, within)}
    for share in TIGHTER if memory_limit is not None else ():
        try:
            tighter = near_optimal(costs, workers, microbatches, share * memory_limit, within)
        except Infeasible:
            break
        for candidate in tighter:
            found.setdefault(str(candidate.plan), candidate)
    return list(found.values())


def fastest_plan(
    costs: LayerCosts,
    workers: int,
    microbatches: int,
    memory_limit: float | None = None,
    asynchronous: bool = True,
    handoff: float = 0.0,
    within: float = 0.15,
) -> Partition:
    """The plan with the shortest simulated iteration among :func:`candidates` (ties: the better
    objective). Raises :class:`~lightning_roundpipe.schedule.partition.Infeasible` like the partitioner."""
    options = candidates(costs, workers, microbatches, memory_limit, within)
    if len(options) == 1:
        return options[0]

    def period(candidate: Partition) -> float:
        return roundpipe(
            costs, candidate.plan, workers, microbatches, asynchronous=asynchronous, handoff=handoff
        ).period

    return min(options, key=lambda c: (period(c), c.objective))


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


def microbatch_candidates(samples: int, workers: int, smallest: float = 1.0) -> list[int]:
    """Micro-batch counts per round worth simulating for a batch of ``samples``: at least the workers
    (else a worker idles; fewer only when the batch is that small), powers of two and small multiples of
    the workers, and no micro-batch below ``smallest`` samples (the smallest size measured: costs are not
    extrapolated below it)."""
    if samples <= workers:
        return [max(1, samples)]
    counts = {workers, workers + 1, *(2**k for k in range(16)), *(k * workers for k in (2, 3, 4, 6, 8))}
    return sorted(c for c in counts if workers <= c <= samples and samples / c >= smallest - 1e-9)


def exposed_round_trips(costs: LayerCosts, plan: StagePlan, microbatches: int, round_trip: float) -> float:
    """Seconds per batch the devices wait for stage boundaries that no compute hides. A slot's first
    micro-batch needs the previous slot's first output brought down to the host and up again (``round_trip``
    seconds); the previous slot's other micro-batches run meanwhile and hide that much of it. With one
    micro-batch per round nothing hides it, at every boundary. The simulator has no transfer model: this
    is its correction when micro-batch counts are compared (24 GiB on one H200: one micro-batch of 32
    sequences of 2048 tokens ran 0.92x four of 8)."""
    times = stage_times(costs, plan)
    return sum(max(0.0, round_trip - (microbatches - 1) * times[s - 1]) for s in range(1, len(times)))


def plan_with_microbatches(
    costs_at: Callable[[float], LayerCosts],
    samples: int,
    workers: int,
    candidates: Sequence[int],
    memory_limit: float | None = None,
    planner: str = "fastest",
    asynchronous: bool = True,
    round_trip: Callable[[float], float] | None = None,
) -> tuple[int, Partition, dict[int, float]]:
    """The micro-batch count (of ``candidates``) and plan with the shortest simulated time per batch, and
    each feasible count's time.

    ``costs_at(n)``: the layers' costs for a micro-batch of ``n`` samples. Fewer, larger micro-batches
    launch less and keep the devices' matrices large; more, smaller ones keep less activation memory
    per stage, so the memory limit admits a larger fused stage (less recompute) and the round-robin
    fills more workers. ``round_trip(n)``: seconds a boundary of ``n`` samples takes down to the host and
    back (:func:`exposed_round_trips`). Each count gets its own plan under ``memory_limit``; counts no
    plan fits are skipped (all infeasible: the last :class:`Infeasible` is raised)."""
    best: tuple[tuple[float, int], Partition] | None = None
    refused: Infeasible | None = None
    periods: dict[int, float] = {}
    for count in candidates:
        costs = costs_at(samples / count)
        try:
            chosen = automatic_plan(costs, workers, count, memory_limit, planner, asynchronous)
        except Infeasible as e:
            refused = e
            continue
        period = roundpipe(costs, chosen.plan, workers, count, asynchronous=asynchronous).period
        if round_trip is not None:
            period += exposed_round_trips(costs, chosen.plan, count, round_trip(samples / count))
        periods[count] = period
        if best is None or (period, count) < best[0]:
            best = ((period, count), chosen)
    if best is None:
        assert refused is not None
        raise refused
    return best[0][1], best[1], periods
