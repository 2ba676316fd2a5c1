"""The partitioner: a stage plan from measured per-layer costs (paper section 4.4).

Given per-layer forward time ``f``, backward-with-recompute time ``b`` (the cost of a layer in a
backward or fused stage) and memory, choose the forward partition, the fused stage and the backward
partition that minimise ``(M * S + N * (N - 1)) * t_max``: ``S`` slots per round, ``t_max`` the
slowest stage. How:

1. For a fixed ``t_max`` the fewest stages come from filling the fused stage as far as it goes
   (both other partitions then cover fewer layers, and a greedy count never grows when the range
   shrinks), then packing each range greedily. With prefix sums each greedy jump is one binary
   search: a count costs O(S log L).
2. ``t_max`` is one of the contiguous sums of ``f`` or ``b``. Over those candidates, sorted, the
   stage count is a non-increasing step function. A recursive bisection finds the steps, skipping
   every interval whose best possible objective, ``(M * S(hi) + N(N-1)) * t(lo)``, cannot beat the
   best found so far.

Memory of a stage (bytes): forward stages ``2 * sum(params) + max(forward activations)``; backward
and fused stages ``2 * sum(params + grads) + sum(backward activations) + max(backward transients)``
(what autograd keeps adds up over the stage's layers; each layer's recompute and backward
intermediates come and go one layer at a time). Weights and gradients count
twice because the next stage's weights arrive and the previous stage's gradients leave while a stage
computes; activations are those of one micro-batch.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

from lightning_roundpipe.schedule.plan import Stage, StageKind, StagePlan


@dataclass(frozen=True)
class LayerCosts:
    """Measured or estimated costs of each layer (seconds and bytes, one micro-batch)."""

    forward: tuple[float, ...]
    """Forward time without autograd (forward stages)."""
    backward: tuple[float, ...]
    """Recompute plus backward time (backward and fused stages; the loss included in the last layer)."""
    params: tuple[int, ...] = ()
    grads: tuple[int, ...] = ()
    forward_activations: tuple[int, ...] = ()
    """Peak transient memory of the layer's forward without autograd."""
    backward_activations: tuple[int, ...] = ()
    """Memory autograd keeps for the layer between recompute and backward."""
    backward_transients: tuple[int, ...] = ()
    """Peak memory of the layer's recompute and backward beyond what autograd keeps and its gradients
    (intermediates, workspaces); one layer's at a time, so a stage needs the largest of them."""

    def __post_init__(self) -> None:
        n = len(self.forward)
        zeros = (0,) * n
        sized = ("params", "grads", "forward_activations", "backward_activations", "backward_transients")
        for name in sized:
            if not getattr(self, name):
                object.__setattr__(self, name, zeros)
        for name in ("backward", *sized):
            if len(getattr(self, name)) != n:
                raise ValueError(f"LayerCosts.{name} has {len(getattr(self, name))} entries for {n} layers")
        if n == 0:
            raise ValueError("LayerCosts needs at least one layer")

    @property
    def num_layers(self) -> int:
        return len(self.forward)


def stage_times(costs: LayerCosts, plan: StagePlan) -> list[float]:
    """Each slot's time under ``plan``: forward stages sum forward times, the others recompute+backward."""
    return [sum((costs.forward if s.kind.value == "F" else costs.backward)[s.start : s.stop]) for s in plan.stages()]


def span_memory(costs: LayerCosts, start: int, stop: int, forward: bool) -> float:
    """Bytes layers ``start..stop-1`` need on a device as one forward stage (``forward``) or one backward
    or fused stage, under the model in this module's docstring."""
    c = costs
    if forward:
        return 2 * sum(c.params[start:stop]) + max(c.forward_activations[start:stop])
    state = sum(2 * (p + g) for p, g in zip(c.params[start:stop], c.grads[start:stop]))
    return state + sum(c.backward_activations[start:stop]) + max(c.backward_transients[start:stop])


def stage_memory(costs: LayerCosts, stage: Stage) -> float:
    """Bytes ``stage`` needs on a device (:func:`span_memory`)."""
    return span_memory(costs, stage.start, stage.stop, stage.kind is StageKind.FORWARD)


@dataclass(frozen=True)
class Partition:
    plan: StagePlan
    t_max: float
    objective: float


class Infeasible(ValueError):
    """No plan fits the memory limit; the message names the layer and the numbers."""


def objective(num_slots: int, t_max: float, microbatches: int, workers: int) -> float:
    """Total device time of one iteration. A round of fewer slots than workers leaves workers idle as if
    it had ``workers`` slots, so it is charged that many (the paper's formula assumes ``S >= N``)."""
    return (microbatches * max(num_slots, workers) + workers * (workers - 1)) * t_max


def partition(costs: LayerCosts, workers: int, microbatches: int, memory_limit: float | None = None) -> Partition:
    """The plan minimising ``(M * S + N * (N - 1)) * t_max`` under ``memory_limit`` (bytes, per stage)."""
    if workers < 1 or microbatches < 1:
        raise ValueError(f"need at least one worker and micro-batch, got {workers=} {microbatches=}")
    limit = float("inf") if memory_limit is None else float(memory_limit)
    packer = _Packer(costs, limit)
    candidates = packer.candidates()
    best: list[tuple[float, int, float]] = []  # (objective, slots, t)

    def value(index: int) -> tuple[float, int]:
        slots = packer.count(candidates[index])
        obj = float("inf") if slots is None else objective(slots, candidates[index], microbatches, workers)
        if not best or obj < best[0][0]:
            best[:] = [(obj, slots or 0, candidates[index])]
        return obj, (slots if slots is not None else 10**9)

    lo, hi = 0, len(candidates) - 1
    _, s_lo = value(lo)
    _, s_hi = value(hi)

    def search(lo: int, hi: int, s_lo: int, s_hi: int) -> None:
        # candidates[lo] < candidates[hi]; every t in between needs between s_hi and s_lo slots
        if hi - lo <= 1 or s_lo == s_hi:
            return
        if s_hi < 10**9 and objective(s_hi, candidates[lo], microbatches, workers) >= best[0][0]:
            return
        mid = (lo + hi) // 2
        _, s_mid = value(mid)
        search(lo, mid, s_lo, s_mid)
        search(mid, hi, s_mid, s_hi)

    search(lo, hi, s_lo, s_hi)
    obj, _, t_max = best[0]
    if obj == float("inf"):
        raise Infeasible(packer.infeasibility())
    plan = spread(packer.plan(t_max), workers)
    return Partition(plan, t_max, objective(plan.num_slots, t_max, microbatches, workers))


def near_optimal(
    costs: LayerCosts, workers: int, microbatches: int, memory_limit: float | None = None, within: float = 0.15
) -> list[Partition]:
    """The best plan of every stage count whose objective is within ``within`` of the optimum, best
    first (the first is :func:`partition`'s). The objective is the paper's proxy for iteration time; it
    misses what the simulator sees (a larger fused stage recomputes less; where stages of unequal time
    fall in the round), so these are the candidates a simulation picks from (:mod:`.choose`).

    Per stage count ``S`` the best plan has the smallest ``t_max`` that packs into ``S`` slots: one
    binary search over the sorted candidates each, since the count does not grow with ``t``."""
    best = partition(costs, workers, microbatches, memory_limit)
    packer = _Packer(costs, float("inf") if memory_limit is None else float(memory_limit))
    candidates = packer.candidates()
    counts: dict[int, int | None] = {}

    def count(index: int) -> int:
        if index not in counts:
            counts[index] = packer.count(candidates[index])
        return 10**9 if counts[index] is None else counts[index]  # type: ignore[return-value]

    bound = (1 + within) * best.objective
    found: dict[str, Partition] = {}

    def keep(candidate: Partition) -> None:  # spreading over the workers can make two counts one plan
        key = str(candidate.plan)
        if key not in found or candidate.objective < found[key].objective:
            found[key] = candidate

    slots, most = count(len(candidates) - 1), count(0)  # the fewest; the most any candidate needs
    # no t is below the smallest candidate, so from here on more slots only cost more
    while slots <= most and objective(slots, candidates[0], microbatches, workers) <= bound:
        lo, hi = 0, len(candidates) - 1  # the first candidate that packs into at most ``slots``
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if count(mid) <= slots else (mid + 1, hi)
        t, exact = candidates[lo], count(lo) == slots
        slots += 1
        if not exact or objective(slots - 1, t, microbatches, workers) > bound:
            continue
        plan = spread(packer.plan(t), workers)
        keep(Partition(plan, t, objective(plan.num_slots, t, microbatches, workers)))
    keep(best)
    return sorted(found.values(), key=lambda p: (p.objective, p.plan.num_slots))


def spread(plan: StagePlan, workers: int) -> StagePlan:
    """Split multi-layer stages (the largest first) toward ``workers`` slots, so every worker has a
    stage. Splitting the fused stage hands its lower half to a new forward stage and a new backward
    stage (two slots; only while that does not overshoot). No stage gets slower and the objective,
    which charges fewer slots than workers as ``workers``, does not change."""
    while plan.num_slots < workers:
        # the largest stage, forward ones first and later ones first among equals
        sizes = [(n, 1, i, i) for i, n in enumerate(plan.forward) if n > 1]
        sizes += [(n, 0, i, len(plan.forward) + i) for i, n in enumerate(plan.backward) if i > 0 and n > 1]
        if sizes:
            plan = plan.split(max(sizes)[3])
        elif plan.backward[0] > 1 and plan.num_slots + 2 <= workers:  # the fused stage: adds two slots
            plan = plan.split(len(plan.forward))
        else:
            break
    return plan


class _Packer:
    """Greedy packing of layers into stages under a time bound and the memory limit."""

    def __init__(self, costs: LayerCosts, limit: float) -> None:
        self.costs = costs
        self.limit = limit
        self.L = costs.num_layers
        c = costs
        self.f_prefix = list(itertools.accumulate(c.forward, initial=0.0))
        # backward partitions run from the last layer down: index j is layer L-1-j
        self.b_prefix = list(itertools.accumulate(reversed(c.backward), initial=0.0))
        state_f = [2 * p for p in c.params]
        state_b = [2 * (p + g) for p, g in zip(c.params, c.grads)]
        zeros = [0.0] * self.L
        self.f_reach = self._memory_reach(state_f, zeros, list(c.forward_activations))
        kept, transient = list(c.backward_activations)[::-1], list(c.backward_transients)[::-1]
        self.b_reach = self._memory_reach(state_b[::-1], kept, transient)

    def _memory_reach(self, state: list[float], kept: list[float], peaks: list[float]) -> list[int]:
        """For each start i, the end j (exclusive, largest) such that layers i..j-1 fit the limit: their
        state and kept memory add up, their peaks come one at a time."""
        reach = []
        for i in range(self.L):
            total, top, j = 0.0, 0.0, i
            while j < self.L:
                total += state[j] + kept[j]
                top = max(top, peaks[j])
                if total + top > self.limit:
                    break
                j += 1
            reach.append(j)
        return reach

    def candidates(self) -> list[float]:
        values = set()
        for prefix in (self.f_prefix, self.b_prefix):
            for i in range(len(prefix)):
                for j in range(i + 1, len(prefix)):
                    values.add(prefix[j] - prefix[i])
        lower = max(max(self.costs.forward), max(self.costs.backward))
        return sorted(v for v in values if v >= lower - 1e-15 * lower)

    @staticmethod
    def _jumps(prefix: list[float], reach: list[int], start: int, stop: int, t: float) -> list[int] | None:
        """Greedy stage boundaries covering ``start..stop-1``; ``None`` if some layer cannot fit."""
        bounds = []
        i = start
        while i < stop:
            j = min(bisect.bisect_right(prefix, prefix[i] + t * (1 + 1e-12)) - 1, reach[i], stop)
            if j <= i:
                return None
            bounds.append(j)
            i = j
        return bounds

    def _split(self, t: float) -> tuple[int, list[int], list[int]] | None:
        # the fused stage: as many of the last layers as fit
        fused = min(bisect.bisect_right(self.b_prefix, t * (1 + 1e-12)) - 1, self.b_reach[0], self.L)
        if fused == 0:
            return None
        rest = self.L - fused
        backward = self._jumps(self.b_prefix, self.b_reach, fused, self.L, t)
        forward = self._jumps(self.f_prefix, self.f_reach, 0, rest, t)
        if backward is None or forward is None:
            return None
        return fused, forward, backward

    def count(self, t: float) -> int | None:
        split = self._split(t)
        if split is None:
            return None
        _, forward, backward = split
        return 1 + len(forward) + len(backward)

    def plan(self, t: float) -> StagePlan:
        split = self._split(t)
        assert split is not None
        fused, forward, backward = split
        f_sizes = [b - a for a, b in zip([0, *forward[:-1]], forward)]
        b_sizes = [b - a for a, b in zip([fused, *backward[:-1]], backward)]
        return StagePlan(tuple(f_sizes), (fused, *b_sizes))

    def infeasibility(self) -> str:
        c = self.costs
        for i in range(self.L):
            need_b = 2 * (c.params[i] + c.grads[i]) + c.backward_activations[i] + c.backward_transients[i]
            need_f = 2 * c.params[i] + c.forward_activations[i]
            if max(need_b, need_f) > self.limit:
                return (
                    f"layer {i} needs {max(need_b, need_f) / 2**30:.2f} GiB as a stage of its own (parameters"
                    f" {c.params[i] / 2**30:.2f} GiB, gradients {c.grads[i] / 2**30:.2f} GiB, activations of one"
                    f" micro-batch {c.backward_activations[i] / 2**30:.2f} GiB kept and"
                    f" {c.backward_transients[i] / 2**30:.2f} GiB transient, weights and gradients counted twice"
                    f" for prefetch) but the limit is {self.limit / 2**30:.2f} GiB. Use smaller micro-batches, a"
                    " device with more memory, or split the layer (a Hugging Face model's decoder layers:"
                    " RoundPipeStrategy(split_decoder_layers=True))."
                )
        return f"no plan fits the memory limit of {self.limit / 2**30:.2f} GiB"


def brute_force(costs: LayerCosts, workers: int, microbatches: int, memory_limit: float | None = None) -> float:
    """The optimal objective by enumerating every plan (for tests, small ``L`` only)."""
    limit = float("inf") if memory_limit is None else float(memory_limit)
    c = costs
    L = c.num_layers

    def fwd_ok(a: int, b: int) -> bool:
        return span_memory(c, a, b, forward=True) <= limit

    def bwd_ok(a: int, b: int) -> bool:
        return span_memory(c, a, b, forward=False) <= limit

    def fronts(n: int, ok, time) -> dict[int, float]:
        """Over all ways to cut layers 0..n-1 into contiguous stages: stage count -> least max stage time."""
        out: dict[int, float] = {}
        if n == 0:
            return {0: 0.0}
        for mask in range(1 << (n - 1)):
            cuts = [0] + [i + 1 for i in range(n - 1) if mask >> i & 1] + [n]
            if all(ok(a, b) for a, b in itertools.pairwise(cuts)):
                t = max(time(a, b) for a, b in itertools.pairwise(cuts))
                k = len(cuts) - 1
                out[k] = min(out.get(k, float("inf")), t)
        return out

    best = float("inf")
    for fused in range(1, L + 1):
        a = L - fused
        if not bwd_ok(a, L):
            continue
        t_fused = sum(c.backward[a:L])
        f_front = fronts(a, fwd_ok, lambda x, y: sum(c.forward[x:y]))
        b_front = fronts(a, bwd_ok, lambda x, y: sum(c.backward[x:y]))
        for kf, tf in f_front.items():
            for kb, tb in b_front.items():
                t = max(t_fused, tf, tb)
                best = min(best, objective(1 + kf + kb, t, microbatches, workers))
    return best
