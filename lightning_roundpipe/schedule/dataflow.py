"""What each compute action reads and writes: boundary activations and boundary gradients per micro-batch.

A key ``("act", k, m)`` is the input of layer ``k`` for micro-batch ``m``; ``("grad", k, m)`` is the
gradient of the loss with respect to it. ``("act", 0, m)`` is the micro-batch itself and exists from the
start. The engine wires mailboxes from these keys and the validator checks schedules with them, so
both read one definition.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from lightning_roundpipe.schedule.actions import Action, Op
from lightning_roundpipe.schedule.plan import StagePlan

Key = tuple[str, int, int]


def consumes(action: Action, plan: StagePlan) -> tuple[Key, ...]:
    """Keys the action waits for."""
    if not action.op.is_compute:
        return ()
    stage = plan.stages()[action.slot]
    m = action.microbatch
    assert m is not None
    if action.op is Op.BACKWARD:
        return (("act", stage.start, m), ("grad", stage.stop, m))
    return (("act", stage.start, m),)


def produces(action: Action, plan: StagePlan) -> tuple[Key, ...]:
    """Keys the action makes available, in the order it publishes them."""
    if not action.op.is_compute:
        return ()
    stage = plan.stages()[action.slot]
    m = action.microbatch
    assert m is not None
    if action.op is Op.FORWARD:
        saved = [k for k in plan.saved_boundaries() if stage.start < k < stage.stop]
        return (*(("act", k, m) for k in saved), ("act", stage.stop, m))
    return (("grad", stage.start, m),) if stage.start > 0 else ()


def is_initial(key: Key) -> bool:
    """Keys that exist before any action runs: the micro-batches."""
    return key[0] == "act" and key[1] == 0


def consumer_counts(actions: Iterable[Action], plan: StagePlan) -> Counter[Key]:
    """How many actions read each key: the engine frees a key's value after its last reader."""
    return Counter(key for action in actions for key in consumes(action, plan))
