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


_ACTION_RE = re.compile(r"^(\d+):([WFLBG])(\d+)(?:\.(\d+))?(?:~(\d+)/(\d+))?$")


@dataclass(frozen=True)
class Action:
    """One thing one worker does: ``op`` on stage ``slot`` of ``round``.

    Compute actions are for one micro-batch; transfer actions (``W``, ``G``) may be one part of a
    transfer cut into ``parts`` pieces. Printed as ``"round:OPslot.microbatch"`` or
    ``"round:OPslot~part/parts"``: ``"1:B4.6"`` is round 1, backward stage in slot 4, micro-batch 6;
    ``"0:W2~1/4"`` is the second of four parts of the upload of slot 2's weights.
    """

    op: Op
    round: int
    slot: int
    microbatch: int | None = None
    part: int = 0
    parts: int = 1

    def __post_init__(self) -> None:
        if self.op.is_compute != (self.microbatch is not None):
            raise ValueError(f"{self.op.name} actions {'need' if self.op.is_compute else 'take no'} micro-batch")
        if not 0 <= self.part < self.parts or (self.op.is_compute and self.parts != 1):
            raise ValueError(f"bad part {self.part}/{self.parts} for a {self.op.name} action")

    @property
    def is_first_part(self) -> bool:
        return self.part == 0

    @property
    def is_last_part(self) -> bool:
        return self.part == self.parts - 1

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else f".{self.microbatch}"
        part = "" if self.parts == 1 else f"~{self.part}/{self.parts}"
        return f"{self.round}:{self.op.value}{self.slot}{mb}{part}"

    @classmethod
    def parse(cls, text: str) -> Action:
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ValueError(f"cannot read action {text!r}: expected e.g. '0:F2.3', '1:W4' or '1:W4~0/3'")
        rnd, op, slot, mb, part, parts = match.groups()
        return cls(
            Op(op),
            int(rnd),
            int(slot),
            None if mb is None else int(mb),
            0 if part is None else int(part),
            1 if parts is None else int(parts),
        )
