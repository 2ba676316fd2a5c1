"""A pipeline simulator: timelines and bubble ratios of pipeline schedules from per-layer times.

Every schedule becomes per-worker task lists with dependencies; :func:`run` places each task at the
earliest time its worker is free and its inputs exist. RoundPipe's tasks come from the very schedule
the engine executes (:func:`~lightning_roundpipe.schedule.dispatch.round_robin`), with dispatch
continuing across iterations. The baselines (GPipe, 1F1B, interleaved 1F1B, looped BFS) bind stages
to workers and use one partition for forward and backward, balanced by forward+backward time. All
schedules recompute activations: a backward task costs recompute + backward.

The bubble ratio of an iteration is ``1 - work / (N * period)`` with ``period`` the steady-state time
per iteration (several iterations are simulated; a synchronous schedule drains between them, an
asynchronous one does not). :func:`bubbles` splits it into *imbalance* (what equalising all stage
times would remove) and *structural* (what remains: fill and drain, which for synchronous schedules
happen at every iteration boundary).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_roundpipe.schedule.dispatch import Schedule, round_robin
from lightning_roundpipe.schedule.partition import LayerCosts, stage_times
from lightning_roundpipe.schedule.plan import StageKind, StagePlan

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "roundpipe-sync", "roundpipe-async")


@dataclass
class Task:
    worker: int
    label: str
    duration: float
    deps: list[int] = field(default_factory=list)
    iteration: int = 0
    after: list[tuple[int, float]] = field(default_factory=list)
    """Dependencies with a lag: the task starts no earlier than ``lag`` seconds after each one ends."""


@dataclass
class Timeline:
    tasks: list[Task]
    start: list[float]
    end: list[float]
    workers: int
    iterations: int

    def iteration_end(self, iteration: int) -> float:
        return max(e for t, e in zip(self.tasks, self.end) if t.iteration == iteration)

    @property
    def period(self) -> float:
        """Steady-state time per iteration (the middle iterations; the whole run if only one)."""
        if self.iterations < 3:
            return self.iteration_end(self.iterations - 1) / self.iterations
        return (self.iteration_end(self.iterations - 1) - self.iteration_end(0)) / (self.iterations - 1)

    @property
    def work_per_iteration(self) -> float:
        return sum(t.duration for t in self.tasks) / self.iterations

    @property
    def bubble_ratio(self) -> float:
        """Idle fraction of the workers in steady state: between the ends of the first and the
        second-to-last iteration (the last one's drain is not steady state), the work actually done
        there. Asynchronous iterations overlap: whole iterations' work over such a window could exceed
        it and give a negative ratio."""
        if self.iterations < 3:
            return 1.0 - self.work_per_iteration / (self.workers * self.period)
        a, b = self.iteration_end(0), self.iteration_end(self.iterations - 2)
        busy = sum(max(0.0, min(e, b) - max(s, a)) for s, e in zip(self.start, self.end))
        return max(0.0, 1.0 - busy / (self.workers * (b - a)))  # (rounding can give -2e-16)

    def chrome_trace(self) -> dict:
        """The timeline as Chrome-trace JSON (open in Perfetto or chrome://tracing); times in us."""
        events = [
            {"name": t.label, "ph": "X", "pid": 0, "tid": t.worker, "ts": s * 1e6, "dur": (e - s) * 1e6,
             "args": {"iteration": t.iteration}}
            for t, s, e in zip(self.tasks, self.start, self.end)
        ]  # fmt: skip
        return {"traceEvents": events, "displayTimeUnit": "ms"}


def run(tasks: list[Task], order: list[list[int]], iterations: int) -> Timeline:
    """Place tasks: each worker runs its ``order`` list in sequence, each task after its ``deps``."""
    n = len(tasks)
    start, end = [0.0] * n, [0.0] * n
    done = [False] * n
    position = [0] * len(order)
    free = [0.0] * len(order)
    remaining = n
    while remaining:
        progressed = False
        for w, queue in enumerate(order):
            while position[w] < len(queue):
                i = queue[position[w]]
                task = tasks[i]
                if not all(done[d] for d in task.deps) or not all(done[d] for d, _ in task.after):
                    break
                start[i] = max([free[w], *(end[d] for d in task.deps), *(end[d] + lag for d, lag in task.after)])
                end[i] = start[i] + tasks[i].duration
                free[w] = end[i]
                done[i] = True
                position[w] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [tasks[q[position[w]]].label for w, q in enumerate(order) if position[w] < len(q)]
            raise ValueError(f"schedule deadlocks; workers wait at {stuck}")
    return Timeline(tasks, start, end, len(order), iterations)


# ---------------------------------------------------------------------- RoundPipe
def roundpipe(
    costs: LayerCosts,
    plan: StagePlan,
    workers: int,
    microbatches: int,
    iterations: int = 4,
    asynchronous: bool = True,
    rounds: int = 1,
    slot_times: Sequence[float] | None = None,
    handoff: float = 0.0,
) -> Timeline:
    """RoundPipe over ``iterations`` steps of ``microbatches`` (``rounds`` rounds each).

    ``handoff``: seconds from the last loss of one iteration to the earliest start of the next
    iteration's first slot. The next batch exists only once the host has every loss of this one (the
    training loop's turn), and its first slot's weights are uploaded only then: nothing can prefetch
    them earlier. Asynchronously a fused slot's loss goes to the host before its backward (its forward
    share is the layers' forward times), so that backward hides part of it; slots after the fused one
    hide the rest. Synchronously the whole handoff follows the batch.
    """
    stages = plan.stages()
    fused = [s for s, stage in enumerate(stages) if stage.kind is StageKind.FUSED]
    times = stage_times(costs, plan) if slot_times is None else list(slot_times)
    # asynchronously a fused slot's loss is on the host once its forward ran, that much before the slot
    # ends; synchronously the next batch waits for this one to settle anyway
    backward_share = {
        s: max(0.0, times[s] - sum(costs.forward[stages[s].start : stages[s].stop])) if asynchronous else 0.0
        for s in fused
    }
    mb_per_round = microbatches // rounds
    tasks: list[Task] = []
    order: list[list[int]] = [[] for _ in range(workers)]
    first = 0
    barrier: list[int] = []
    losses: list[tuple[int, float]] = []  # (task, how long before its end the loss is on the host)
    schedules: dict[int, Schedule] = {}  # one per first worker: iterations repeat them
    for it in range(iterations):
        if first not in schedules:
            schedules[first] = round_robin(plan, workers, mb_per_round, rounds, first)
        schedule = schedules[first]
        first = schedule.next_first_worker
        index: dict[tuple[int, int], int] = {}
        for w, actions in enumerate(schedule.workers):
            for a in actions:
                assert a.microbatch is not None
                index[(a.slot, a.microbatch)] = len(tasks)
                label = f"{it}:{a.op.value}{a.slot}.{a.microbatch}"
                tasks.append(Task(w, label, times[a.slot], [] if asynchronous else list(barrier), it))
                order[w].append(len(tasks) - 1)
        for (slot, m), i in index.items():
            if slot > 0:  # a micro-batch leaves one slot for the next
                tasks[i].deps.append(index[(slot - 1, m)])
        if it > 0 and handoff > 0:
            for m in range(microbatches):
                tasks[index[(0, m)]].after += [(i, handoff - early) for i, early in losses]
        losses = [(index[(s, m)], backward_share[s]) for s in fused for m in range(microbatches)]
        barrier = [index[(len(stages) - 1, m)] for m in range(microbatches)]
    return run(tasks, order, iterations)


# ---------------------------------------------------------------------- stage-bound baselines
def balanced_stages(costs: LayerCosts, count: int) -> list[tuple[int, int]]:
    """Split layers into ``count`` contiguous stages minimising the largest forward+backward time."""
    total = [f + b for f, b in zip(costs.forward, costs.backward)]
    if count > len(total):
        raise ValueError(f"cannot make {count} stages of {len(total)} layers")
    prefix = list(itertools.accumulate(total, initial=0.0))

    def cut(t: float) -> list[tuple[int, int]] | None:
        bounds, i = [], 0
        while i < len(total):
            j = i + 1
            while j < len(total) and prefix[j + 1] - prefix[i] <= t:
                j += 1
            if prefix[j] - prefix[i] > t:
                return None
            bounds.append((i, j))
            i = j
        return bounds if len(bounds) <= count else None

    candidates = sorted({prefix[j] - prefix[i] for i in range(len(total)) for j in range(i + 1, len(total) + 1)})
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if cut(candidates[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    bounds = cut(candidates[lo])
    assert bounds is not None
    while len(bounds) < count:  # split the largest multi-layer stage until there are `count`
        k = max((b for b in range(len(bounds)) if bounds[b][1] - bounds[b][0] > 1),
                key=lambda b: prefix[bounds[b][1]] - prefix[bounds[b][0]])  # fmt: skip
        a, z = bounds[k]
        bounds[k : k + 1] = [(a, a + (z - a) // 2), (a + (z - a) // 2, z)]
    return bounds


def _bound(
    costs: LayerCosts,
    workers: int,
    microbatches: int,
    chunks: int,
    iterations: int,
    order_of: str,
    stage_times: tuple[Sequence[float], Sequence[float]] | None = None,
) -> Timeline:
    """Schedules binding stage ``j`` to worker ``j mod N`` (``chunks`` stages per worker)."""
    count = workers * chunks
    bounds = balanced_stages(costs, count)
    if stage_times is None:
        fwd = [sum(costs.forward[a:b]) for a, b in bounds]
        bwd = [sum(costs.backward[a:b]) for a, b in bounds]
    else:
        fwd, bwd = list(stage_times[0]), list(stage_times[1])
    tasks: list[Task] = []
    order: list[list[int]] = [[] for _ in range(workers)]
    barrier: list[int] = []
    for it in range(iterations):
        f_id: dict[tuple[int, int], int] = {}
        b_id: dict[tuple[int, int], int] = {}
        for s in range(count):
            for m in range(microbatches):
                f_id[(s, m)] = len(tasks)
                tasks.append(Task(s % workers, f"{it}:F{s}.{m}", fwd[s], list(barrier), it))
        for s in range(count):
            for m in range(microbatches):
                b_id[(s, m)] = len(tasks)
                tasks.append(Task(s % workers, f"{it}:B{s}.{m}", bwd[s], list(barrier), it))
        for (s, m), i in f_id.items():
            if s > 0:
                tasks[i].deps.append(f_id[(s - 1, m)])
        for (s, m), i in b_id.items():
            tasks[i].deps.append(b_id[(s + 1, m)] if s + 1 < count else f_id[(s, m)])
        for w in range(workers):
            order[w] += _worker_order(order_of, w, workers, chunks, microbatches, f_id, b_id)
        barrier = [b_id[(0, m)] for m in range(microbatches)]
    return run(tasks, order, iterations)


def _worker_order(
    kind: str, w: int, n: int, v: int, m: int, f_id: dict[tuple[int, int], int], b_id: dict[tuple[int, int], int]
) -> list[int]:
    mine = [c * n + w for c in range(v)]  # this worker's stages, first to last
    if kind == "gpipe":
        return [f_id[(mine[0], j)] for j in range(m)] + [b_id[(mine[0], j)] for j in range(m)]
    if kind == "looped-bfs":
        forward = [f_id[(s, j)] for s in mine for j in range(m)]
        return forward + [b_id[(s, j)] for s in reversed(mine) for j in range(m)]
    if kind == "1f1b":
        s = mine[0]
        warm = min(n - w - 1, m)
        out = [f_id[(s, j)] for j in range(warm)]
        for j in range(m - warm):
            out += [f_id[(s, warm + j)], b_id[(s, j)]]
        return out + [b_id[(s, j)] for j in range(m - warm, m)]
    if kind == "interleaved-1f1b":  # Megatron's ordering; micro-batches in groups of n
        total = m * v

        def fwd(k: int) -> int:
            return f_id[(mine[(k // n) % v], (k // (n * v)) * n + k % n)]

        def bwd(k: int) -> int:
            return b_id[(mine[v - 1 - (k // n) % v], (k // (n * v)) * n + k % n)]

        warm = min((n - w - 1) * 2 + (v - 1) * n, total)
        out = [fwd(k) for k in range(warm)]
        for k in range(total - warm):
            out += [fwd(warm + k), bwd(k)]
        return out + [bwd(k) for k in range(total - warm, total)]
    raise ValueError(f"unknown schedule {kind!r}; choose from {SCHEDULES}")


def _chunks(schedule: str, chunks: int) -> int:
    """Stages per worker: looped schedules hold ``chunks``, the others one."""
    return chunks if schedule in ("interleaved-1f1b", "looped-bfs") else 1


def simulate(
    schedule: str,
    costs: LayerCosts,
    workers: int,
    microbatches: int,
    plan: StagePlan | None = None,
    chunks: int = 2,
    iterations: int = 4,
    handoff: float = 0.0,
) -> Timeline:
    """The timeline of ``schedule`` (one of :data:`SCHEDULES`); RoundPipe needs ``plan`` and takes a
    ``handoff`` between iterations (see :func:`roundpipe`)."""
    if schedule.startswith("roundpipe"):
        if plan is None:
            raise ValueError("RoundPipe needs a stage plan (see lightning_roundpipe.schedule.partition)")
        return roundpipe(costs, plan, workers, microbatches, iterations, schedule == "roundpipe-async", handoff=handoff)
    if schedule == "interleaved-1f1b" and microbatches % workers:
        raise ValueError(f"interleaved 1F1B needs micro-batches ({microbatches}) in multiples of workers ({workers})")
    return _bound(costs, workers, microbatches, _chunks(schedule, chunks), iterations, schedule)


@dataclass(frozen=True)
class Bubbles:
    total: float
    imbalance: float
    structural: float
    """Fill and drain; for synchronous schedules this sits at every iteration boundary."""


def bubbles(
    schedule: str,
    costs: LayerCosts,
    workers: int,
    microbatches: int,
    plan: StagePlan | None = None,
    chunks: int = 2,
    iterations: int = 4,
) -> Bubbles:
    """Steady-state bubble ratio split into imbalance (equalising stage times removes it) and structure."""
    actual = simulate(schedule, costs, workers, microbatches, plan, chunks, iterations)
    if schedule.startswith("roundpipe"):
        assert plan is not None
        times = stage_times(costs, plan)
        mean = sum(times) / len(times)
        even = roundpipe(costs, plan, workers, microbatches, iterations, schedule == "roundpipe-async",
                         slot_times=[mean] * len(times))  # fmt: skip
    else:
        v = _chunks(schedule, chunks)
        bounds = balanced_stages(costs, workers * v)
        fwd = [sum(costs.forward[a:b]) for a, b in bounds]
        bwd = [sum(costs.backward[a:b]) for a, b in bounds]
        mf, mb = sum(fwd) / len(fwd), sum(bwd) / len(bwd)
        even = _bound(costs, workers, microbatches, v, iterations, schedule, ([mf] * len(fwd), [mb] * len(bwd)))
    total, structural = actual.bubble_ratio, even.bubble_ratio
    return Bubbles(total, total - structural, structural)
