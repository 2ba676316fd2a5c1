"""Round-robin dispatch: turning a stage plan into each worker's ordered list of actions for one batch.

With ``N`` workers and ``S`` slots per round, slot ``i`` of round ``r`` runs on worker
``(g0 + r * S + i) mod N``, where ``g0`` is the worker the batch starts on; the next batch starts where
this one ended, so no worker is singled out across steps. Each worker runs every micro-batch of its
slot before moving to its next slot. Example, 2 workers, plan ``"2|1,1,1"`` (4 slots), 2 micro-batches::

    w0 | 0:F0.0 0:F0.1 | 0:B2.0 0:B2.1
    w1 | 0:L1.0 0:L1.1 | 0:B3.0 0:B3.1

:func:`round_robin` gives the compute-only schedule;
:func:`lightning_roundpipe.schedule.transfers.add_transfers` adds the weight uploads and gradient
downloads.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from lightning_roundpipe.schedule.actions import Action, Op
from lightning_roundpipe.schedule.plan import Stage, StageKind, StagePlan


@dataclass(frozen=True)
class Schedule:
    """Per-worker action lists for one batch, and the dispatch position it started from."""

    plan: StagePlan
    num_workers: int
    microbatches_per_round: int
    num_rounds: int
    first_worker: int
    workers: tuple[tuple[Action, ...], ...]
    overlap: str | None = None
    """How transfers were placed (see :mod:`~lightning_roundpipe.schedule.transfers`); ``None``: none yet."""
    forward_only: bool = False
    """An evaluation pass: no backward stages (see :func:`round_robin`)."""

    def stages(self) -> tuple[Stage, ...]:
        """The plan's stages this schedule runs."""
        return tuple(s for s in self.plan.stages() if not (self.forward_only and s.kind is StageKind.BACKWARD))

    @property
    def num_microbatches(self) -> int:
        return self.microbatches_per_round * self.num_rounds

    @property
    def next_first_worker(self) -> int:
        """Where the next batch's first slot goes: dispatch continues across batches and steps."""
        return (self.first_worker + self.num_rounds * self.plan.num_slots) % self.num_workers

    def worker_of(self, round: int, slot: int) -> int:
        return (self.first_worker + round * self.plan.num_slots + slot) % self.num_workers

    def actions(self) -> Iterator[tuple[int, Action]]:
        """Every (worker, action) pair, worker by worker."""
        for worker, actions in enumerate(self.workers):
            for action in actions:
                yield worker, action

    def grid(self, mark: tuple[int, int] | None = None) -> str:
        """The schedule as text, one row per worker, slots separated by bars; ``mark=(worker, index)``
        brackets one action, e.g. to point at the one a validator refused."""
        rows = []
        for w, actions in enumerate(self.workers):
            cells: list[str] = []
            prev = None
            for i, action in enumerate(actions):
                if action.op.is_compute:
                    if prev is not None and (action.round, action.slot) != prev:
                        cells.append("|")
                    prev = (action.round, action.slot)
                text = str(action)
                cells.append(f">>{text}<<" if mark == (w, i) else text)
            rows.append(f"w{w} | " + " ".join(cells))
        return "\n".join(rows)


def round_robin(
    plan: StagePlan,
    num_workers: int,
    microbatches_per_round: int,
    num_rounds: int = 1,
    first_worker: int = 0,
    forward_only: bool = False,
) -> Schedule:
    """Compute-only schedule of one batch: ``num_rounds`` rounds of ``microbatches_per_round``.

    ``forward_only``: an evaluation pass, the forward stages and the fused stage (which then only
    computes the output or loss) without backward stages; workers get the slots they would in training.
    """
    if num_workers < 1:
        raise ValueError(f"need at least one worker, got num_workers={num_workers}")
    if microbatches_per_round < 1:
        raise ValueError(f"need at least one micro-batch per round, got {microbatches_per_round}")
    if num_rounds < 1:
        raise ValueError(f"need at least one round, got num_rounds={num_rounds}")
    if not 0 <= first_worker < num_workers:
        raise ValueError(f"first_worker={first_worker} is not a worker index below {num_workers}")
    lists: list[list[Action]] = [[] for _ in range(num_workers)]
    schedule = Schedule(plan, num_workers, microbatches_per_round, num_rounds, first_worker, (), None, forward_only)
    for rnd in range(num_rounds):
        for stage in schedule.stages():
            worker = schedule.worker_of(rnd, stage.slot)
            first_mb = rnd * microbatches_per_round
            for mb in range(first_mb, first_mb + microbatches_per_round):
                lists[worker].append(Action(Op.for_stage(stage.kind), rnd, stage.slot, mb))
    return replace(schedule, workers=tuple(map(tuple, lists)))
