"""Transfer lowering: where weight uploads and gradient downloads go in each worker's action list.

Activation copies ride with their compute action and are on the critical path. Weight uploads
(``W``) and gradient downloads (``G``) are not, and three placements are offered, to compare:

- ``"none"``: upload right before the slot's first compute, download right after its last; the
  executor also keeps them from overlapping compute. The baseline with no overlap.
- ``"simple"``: the next slot's weights are uploaded in one piece when the current slot starts;
  gradients go down in one piece when the slot ends. Overlaps, but a large copy can delay the
  activation copies queued behind it.
- ``"priority"``: a slot with ``M`` micro-batches opens ``M`` windows; the next slot's upload and
  the previous slot's gradient download are cut into ``M`` parts, one per window, each issued
  right after that window's activation copies (paper section 4.2). Example, one worker::

      0:W0 | 0:F0.0 0:W1~0/2 | 0:F0.1 0:W1~1/2 0:G0 | 0:L1.0 0:W2~0/2 | 0:L1.1 0:W2~1/2 ...

:func:`pack_parts` decides which bytes go into which part.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Literal

from lightning_roundpipe.schedule.actions import Action, Op
from lightning_roundpipe.schedule.dispatch import Schedule
from lightning_roundpipe.schedule.plan import StageKind

Overlap = Literal["none", "simple", "priority"]
OVERLAPS: tuple[str, ...] = ("none", "simple", "priority")


def add_transfers(schedule: Schedule, overlap: Overlap = "priority") -> Schedule:
    """Insert ``W`` and ``G`` actions into a compute-only schedule (see the module docstring)."""
    if overlap not in OVERLAPS:
        raise ValueError(f"overlap={overlap!r} is not one of {OVERLAPS}")
    stages = schedule.plan.stages()
    workers = []
    for actions in schedule.workers:
        runs: list[list[Action]] = []
        for action in actions:
            if not runs or (runs[-1][0].round, runs[-1][0].slot) != (action.round, action.slot):
                runs.append([])
            runs[-1].append(action)
        out: list[Action] = []
        for i, run in enumerate(runs):
            rnd, slot = run[0].round, run[0].slot
            has_grads = stages[slot].kind is not StageKind.FORWARD
            nxt = runs[i + 1][0] if i + 1 < len(runs) else None
            prev = runs[i - 1][0] if i > 0 else None
            prev_has_grads = prev is not None and stages[prev.slot].kind is not StageKind.FORWARD
            if overlap == "none" or (overlap != "none" and i == 0):
                out.append(Action(Op.LOAD, rnd, slot))
            if overlap == "simple" and nxt is not None:
                out.append(Action(Op.LOAD, nxt.round, nxt.slot))
            windows = len(run)
            for j, compute in enumerate(run):
                out.append(compute)
                if overlap == "priority":
                    if nxt is not None:
                        out.append(Action(Op.LOAD, nxt.round, nxt.slot, part=j, parts=windows))
                    if prev_has_grads:
                        assert prev is not None
                        out.append(Action(Op.UNLOAD, prev.round, prev.slot, part=j, parts=windows))
            if overlap != "priority" or not has_grads or nxt is None:
                out.append(Action(Op.UNLOAD, rnd, slot))
        workers.append(tuple(out))
    return replace(schedule, workers=tuple(workers), overlap=overlap)


def pack_parts(
    sizes: Sequence[tuple[int, int, int]], parts: int, max_piece_bytes: int | None = None
) -> list[list[tuple[int, int, int]]]:
    """Cut transfers into ``parts`` lists of pieces with similar byte totals.

    ``sizes`` holds ``(key, numel, itemsize)`` per tensor. Tensors above ``max_piece_bytes``
    (default: an even share of the total) are cut into pieces of at most that size; then,
    longest first, each piece goes to the part with the fewest bytes so far (Graham's LPT rule).
    Returns, per part, ``(key, start, stop)`` element ranges in ascending order.
    """
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    total = sum(n * size for _, n, size in sizes)
    limit = max_piece_bytes if max_piece_bytes is not None else max(1, -(-total // parts))
    pieces: list[tuple[int, int, int, int]] = []  # (bytes, key, start, stop)
    for key, numel, itemsize in sizes:
        step = max(1, limit // itemsize)
        for start in range(0, numel, step):
            stop = min(numel, start + step)
            pieces.append(((stop - start) * itemsize, key, start, stop))
    pieces.sort(key=lambda p: (-p[0], p[1], p[2]))
    loads = [0] * parts
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(parts)]
    for nbytes, key, start, stop in pieces:
        target = min(range(parts), key=lambda i: (loads[i], i))
        loads[target] += nbytes
        out[target].append((key, start, stop))
    return [sorted(p) for p in out]
