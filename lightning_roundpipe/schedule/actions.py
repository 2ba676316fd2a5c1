"""Actions: the small immutable records a schedule is made of, with a short printable form that parses back."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from lightning_roundpipe.schedule.plan import StageKind


class Op(str, Enum):
    """What a worker does. Compute ops share their letter with :class:`StageKind`."""

    LOAD = "W"
    """Bring the stage's weights to the worker (upload)."""
    FORWARD = "F"
    FUSED = "L"
    BACKWARD = "B"
    UNLOAD = "G"
    """End of a slot on its worker: gradients go home (if the stage has any); the device copy is freed."""

    @property
    def is_compute(self) -> bool:
        return self in (Op.FORWARD, Op.FUSED, Op.BACKWARD)

    @classmethod
    def for_stage(cls, kind: StageKind) -> Op:
        return cls(kind.value)


_ACTION_RE = re.compile(r"^(\d+):([WFLBG])(\d+)(?:\.(\d+))?$")


@dataclass(frozen=True)
class Action:
    """One thing one worker does: ``op`` on stage ``slot`` of ``round`` for one micro-batch (compute ops only).

    Printed as ``"round:OPslot.microbatch"``, e.g. ``"1:B4.6"`` (round 1, backward stage in slot 4,
    micro-batch 6 of the batch) or ``"0:W2"`` (round 0, upload the weights of slot 2).
    """

    op: Op
    round: int
    slot: int
    microbatch: int | None = None

    def __post_init__(self) -> None:
        if self.op.is_compute != (self.microbatch is not None):
            raise ValueError(f"{self.op.name} actions {'need' if self.op.is_compute else 'take no'} micro-batch")

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else f".{self.microbatch}"
        return f"{self.round}:{self.op.value}{self.slot}{mb}"

    @classmethod
    def parse(cls, text: str) -> Action:
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ValueError(f"cannot read action {text!r}: expected e.g. '0:F2.3' or '1:W4'")
        rnd, op, slot, mb = match.groups()
        return cls(Op(op), int(rnd), int(slot), None if mb is None else int(mb))
