"""Schedule validation: every micro-batch of every slot runs once, and the workers cannot deadlock."""

from __future__ import annotations

from collections import Counter

from lightning_roundpipe.schedule.actions import Action, Op
from lightning_roundpipe.schedule.dataflow import consumes, is_initial, produces
from lightning_roundpipe.schedule.dispatch import Schedule


class ScheduleError(ValueError):
    """A schedule that cannot run as given; the message names the worker, the action and shows the grid."""


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless the schedule is complete and runs to the end.

    Runs the schedule with every action taking one tick: each worker executes its list in order and
    an action may start once every key it consumes was produced. If some worker is stuck, the
    message marks its next action in the grid and lists what it waits for.
    """
    plan = schedule.plan
    expected = Counter(
        (rnd, stage.slot, mb)
        for rnd in range(schedule.num_rounds)
        for stage in schedule.stages()
        for mb in range(rnd * schedule.microbatches_per_round, (rnd + 1) * schedule.microbatches_per_round)
    )
    seen = Counter((a.round, a.slot, a.microbatch) for _, a in schedule.actions() if a.op.is_compute)
    if seen != expected:
        missing = sorted((expected - seen).elements())[:5]
        extra = sorted((seen - expected).elements())[:5]
        raise ScheduleError(
            f"schedule does not run every micro-batch of every slot exactly once (missing (round, slot,"
            f" micro-batch): {missing}, extra: {extra})\n{schedule.grid()}"
        )
    for w, actions in enumerate(schedule.workers):
        _check_transfers(schedule, w, actions)

    available = set()
    position = [0] * schedule.num_workers
    remaining = sum(len(a) for a in schedule.workers)
    while remaining:
        ready: list[tuple[int, Action]] = []
        for w, actions in enumerate(schedule.workers):
            if position[w] < len(actions):
                action = actions[position[w]]
                if all(is_initial(k) or k in available for k in consumes(action, plan)):
                    ready.append((w, action))
        if not ready:
            w = next(w for w in range(schedule.num_workers) if position[w] < len(schedule.workers[w]))
            action = schedule.workers[w][position[w]]
            waits = [k for k in consumes(action, plan) if not is_initial(k) and k not in available]
            _fail(schedule, w, position[w], f"waits forever for {waits}: no worker can make progress")
        for w, action in ready:
            available.update(produces(action, plan))
            position[w] += 1
            remaining -= 1


def _check_transfers(schedule: Schedule, w: int, actions: tuple[Action, ...]) -> None:
    """Every slot a worker computes has its weights uploaded before and its unload after, in all parts."""
    first: dict[tuple[int, int], int] = {}
    last: dict[tuple[int, int], int] = {}
    for i, a in enumerate(actions):
        if a.op.is_compute:
            first.setdefault((a.round, a.slot), i)
            last[(a.round, a.slot)] = i
    if not any(not a.op.is_compute for a in actions):
        return  # a compute-only schedule: transfers not added yet
    seen: dict[tuple[Op, int, int], set[int]] = {}
    for i, a in enumerate(actions):
        if a.op.is_compute:
            continue
        key = (a.round, a.slot)
        if key not in first:
            _fail(schedule, w, i, "moves weights of a slot this worker never computes")
        if a.op is Op.LOAD and i > first[key]:
            _fail(schedule, w, i, "uploads weights after the slot started computing")
        if a.op is Op.UNLOAD and i < last[key]:
            _fail(schedule, w, i, "unloads a slot before its last compute")
        parts = seen.setdefault((a.op, *key), set())
        if a.part in parts:
            _fail(schedule, w, i, "repeats a transfer part")
        parts.add(a.part)
        if len(parts) == a.parts and sorted(parts) != list(range(a.parts)):
            _fail(schedule, w, i, "has inconsistent transfer parts")
    for key in first:
        for op in (Op.LOAD, Op.UNLOAD):
            if (op, *key) not in seen:
                raise ScheduleError(
                    f"worker {w} never runs {op.name} for round {key[0]} slot {key[1]}\n{schedule.grid()}"
                )
    for (op, rnd, slot), parts in seen.items():
        expected = next(a.parts for a in actions if (a.op, a.round, a.slot) == (op, rnd, slot))
        if len(parts) != expected:
            raise ScheduleError(
                f"worker {w}: {op.name} of round {rnd} slot {slot} has parts {sorted(parts)} of {expected}\n"
                f"{schedule.grid()}"
            )


def _fail(schedule: Schedule, worker: int, index: int, why: str) -> None:
    action = schedule.workers[worker][index]
    raise ScheduleError(f"worker {worker}, step {index}, action {action}: {why}\n{schedule.grid(mark=(worker, index))}")
