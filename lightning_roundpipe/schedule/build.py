"""The schedule one batch runs: round-robin compute order, transfers added, validated."""

from __future__ import annotations

import functools

from lightning_roundpipe.schedule.dispatch import Schedule, round_robin
from lightning_roundpipe.schedule.plan import StagePlan
from lightning_roundpipe.schedule.transfers import Overlap, add_transfers
from lightning_roundpipe.schedule.validate import validate


@functools.lru_cache(maxsize=128)
def batch_schedule(
    plan: StagePlan,
    num_workers: int,
    microbatches_per_round: int,
    num_rounds: int,
    first_worker: int,
    overlap: Overlap,
    forward_only: bool = False,
) -> Schedule:
    """What each worker runs for one batch (see :func:`round_robin` and :func:`add_transfers`); a
    schedule that could deadlock or leaves work undone raises :class:`ScheduleError` with its grid.
    Cached: a schedule is immutable, and a run asks for the same few again and again."""
    compute_only = round_robin(plan, num_workers, microbatches_per_round, num_rounds, first_worker, forward_only)
    schedule = add_transfers(compute_only, overlap)
    validate(schedule)
    return schedule
