"""Pure scheduling logic: stage plans, round-robin dispatch and schedule validation (no device work)."""

from lightning_roundpipe.schedule.actions import Action, Op
from lightning_roundpipe.schedule.build import batch_schedule
from lightning_roundpipe.schedule.dispatch import Schedule, round_robin
from lightning_roundpipe.schedule.plan import Stage, StageKind, StagePlan
from lightning_roundpipe.schedule.transfers import OVERLAPS, Overlap, add_transfers, pack_parts
from lightning_roundpipe.schedule.validate import ScheduleError, validate

__all__ = [
    "OVERLAPS",
    "Action",
    "Op",
    "Overlap",
    "Schedule",
    "ScheduleError",
    "Stage",
    "StageKind",
    "StagePlan",
    "add_transfers",
    "batch_schedule",
    "pack_parts",
    "round_robin",
    "validate",
]
