"""Stage plans: the asymmetric forward and backward partitions of a layer sequence into stages."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum


class StageKind(str, Enum):
    """What a stage does with its layers. The value is the one-letter form used in printed schedules."""

    FORWARD = "F"
    """Forward only, no autograd graph kept; emits the inputs that later backward stages recompute from."""
    FUSED = "L"
    """Forward, loss and backward of the last layers in one go: its forward doubles as the recompute."""
    BACKWARD = "B"
    """Recompute the forward of its layers from the saved stage input, then backward."""


@dataclass(frozen=True)
class Stage:
    """One stage of a plan: the contiguous layers ``start..stop-1`` and what is done with them."""

    slot: int
    kind: StageKind
    start: int
    stop: int

    @property
    def layers(self) -> range:
        return range(self.start, self.stop)

    @property
    def has_gradients(self) -> bool:
        return self.kind is not StageKind.FORWARD

    def __str__(self) -> str:
        return f"{self.kind.value}{self.slot}[{self.start}:{self.stop}]"


_PLAN_RE = re.compile(r"^\s*([\d,\s]*)\|([\d,\s]+)$")


@dataclass(frozen=True)
class StagePlan:
    """Forward and backward partitions of ``L`` layers (paper section 3.2).

    ``forward`` holds the layer counts ``F_1..F_Sf`` of the forward-only stages, from layer 0 upwards.
    ``backward`` holds ``B_1..B_Sb`` from the last layer downwards; ``B_1`` is the fused stage, which
    runs the forward of the last ``B_1`` layers, the loss and their backward. So
    ``sum(forward) + backward[0] == sum(backward) == L``.

    The printed form is ``"3,3|1,2,2,2"`` (forward counts, a bar, backward counts) and parses back
    with :meth:`parse`.
    """

    forward: tuple[int, ...]
    backward: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "forward", tuple(int(n) for n in self.forward))
        object.__setattr__(self, "backward", tuple(int(n) for n in self.backward))
        if not self.backward:
            raise ValueError(f"StagePlan needs at least the fused stage in `backward`, got {self}")
        if any(n <= 0 for n in self.forward + self.backward):
            raise ValueError(f"every stage of a StagePlan needs at least one layer, got {self}")
        if sum(self.forward) + self.backward[0] != sum(self.backward):
            raise ValueError(
                f"StagePlan {self} is inconsistent: the forward stages cover {sum(self.forward)} layers and the"
                f" fused stage {self.backward[0]}, which makes {sum(self.forward) + self.backward[0]}, but the"
                f" backward stages cover {sum(self.backward)}. Both must cover every layer exactly once."
            )

    def __str__(self) -> str:
        return ",".join(map(str, self.forward)) + "|" + ",".join(map(str, self.backward))

    @classmethod
    def parse(cls, text: str) -> StagePlan:
        """Read the printed form ``"3,3|1,2,2,2"``; ``"|4"`` is one fused stage of 4 layers."""
        match = _PLAN_RE.match(text)
        if match is None:
            raise ValueError(
                f"cannot read stage plan {text!r}: expected forward layer counts, '|', backward layer counts,"
                " e.g. '3,3|1,2,2,2' for 7 layers"
            )
        fwd, bwd = (tuple(int(n) for n in part.split(",") if n.strip()) for part in match.groups())
        return cls(fwd, bwd)

    @classmethod
    def uniform(cls, num_layers: int, forward_size: int = 3, backward_size: int = 1) -> StagePlan:
        """Forward stages of ``forward_size`` layers and backward stages of ``backward_size`` layers.

        Forward is about a third of recompute plus backward, so the default 3:1 gives stages of similar
        duration for uniform layers until measured costs are available.
        """
        if num_layers <= 0:
            raise ValueError(f"a plan needs at least one layer, got num_layers={num_layers}")
        if forward_size <= 0 or backward_size <= 0:
            raise ValueError(f"stage sizes must be positive, got {forward_size=} and {backward_size=}")
        fused = min(backward_size, num_layers)
        return cls(_chunks(num_layers - fused, forward_size), (fused, *_chunks(num_layers - fused, backward_size)))

    @property
    def num_layers(self) -> int:
        return sum(self.backward)

    @property
    def fused_start(self) -> int:
        """Index of the first layer of the fused stage."""
        return sum(self.forward)

    def stages(self) -> tuple[Stage, ...]:
        """All stages in dispatch (slot) order: forward stages, the fused stage, backward stages."""
        stages: list[Stage] = []
        start = 0
        for n in self.forward:
            stages.append(Stage(len(stages), StageKind.FORWARD, start, start + n))
            start += n
        stop = self.num_layers
        for i, n in enumerate(self.backward):
            kind = StageKind.FUSED if i == 0 else StageKind.BACKWARD
            stages.append(Stage(len(stages), kind, stop - n, stop))
            stop -= n
        return tuple(stages)

    @property
    def num_slots(self) -> int:
        return len(self.forward) + len(self.backward)

    def saved_boundaries(self) -> tuple[int, ...]:
        """Layer indices whose input the forward pass must keep for a backward stage's recompute.

        The fused stage gets its input directly from the last forward stage, so it is not listed.
        """
        return tuple(s.start for s in self.stages() if s.kind is StageKind.BACKWARD)

    def split(self, slot: int) -> StagePlan:
        """This plan with stage ``slot`` cut in two (the larger half first in its partition's order): a
        forward or backward stage becomes two of its kind; the fused stage hands its lower half to a new
        forward stage and a new backward stage (two slots). A one-layer stage cannot be cut."""
        forward, backward = list(self.forward), list(self.backward)
        side, i = (forward, slot) if slot < len(forward) else (backward, slot - len(forward))
        n = side[i]
        if n < 2:
            raise ValueError(f"stage {slot} of plan {self} has one layer: it cannot be split")
        if side is backward and i == 0:
            backward[0] -= n // 2
            forward.append(n // 2)
            backward.insert(1, n // 2)
        else:
            side[i : i + 1] = [n - n // 2, n // 2]
        return StagePlan(tuple(forward), tuple(backward))

    def check_layers(self, num_layers: int) -> None:
        """Refuse a plan made for a different number of layers, naming both numbers."""
        if self.num_layers != num_layers:
            raise ValueError(
                f"stage plan {self} covers {self.num_layers} layers but the model has {num_layers}."
                f" Give a plan whose backward counts sum to {num_layers}, e.g."
                f" {StagePlan.uniform(num_layers)}, or leave `plan=None` for the default."
            )


def _chunks(total: int, size: int) -> tuple[int, ...]:
    full, rest = divmod(total, size)
    return (size,) * full + ((rest,) if rest else ())
