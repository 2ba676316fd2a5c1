"""``torch.compile``'s compilations in this process: how many have started, and the seconds they took. A
batch during which the count moved ran some of its work at compile speed, and its measured times say
nothing about the layers; the seconds are what ``RoundPipeMonitor`` reports as the compile's cost."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

_lock = threading.Lock()
_started = 0
_seconds = 0.0
_since: float | None = None


def compilations() -> int:
    """Compilations started since the count began (-1 before ``torch._dynamo`` was imported: nothing can
    have been compiled yet, and the first compilation imports it, so the count still moves)."""
    if "torch._dynamo" not in sys.modules:
        return -1
    from torch._dynamo.callback import callback_handler

    if _start not in callback_handler.start_callbacks:  # first use, or ``torch._dynamo.reset()`` cleared them
        with _lock:
            if _start not in callback_handler.start_callbacks:
                callback_handler.register_start_callback(_start)
                callback_handler.register_end_callback(_end)
    return _started


def compile_mark() -> int:
    """What a batch notes before it runs and compares after: it moves with every compilation started, and
    reads differently while one is under way (one begun before the batch and ended during it counts)."""
    started = compilations()
    return 2 * started + (_since is not None)


def compile_seconds() -> float:
    """Seconds spent compiling since the count began (overlapping compilations counted once)."""
    return _seconds


def _start(_: Any) -> None:
    global _started, _since
    with _lock:
        _started += 1
        _since = time.perf_counter()


def _end(_: Any) -> None:
    global _seconds, _since
    with _lock:
        if _since is not None:
            _seconds += time.perf_counter() - _since
            _since = None
