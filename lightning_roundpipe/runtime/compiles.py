"""How many ``torch.compile`` compilations have started in this process: a batch during which the count
moved ran some of its work at compile speed, and its measured times say nothing about the layers."""

from __future__ import annotations

import sys
import threading
from typing import Any

_lock = threading.Lock()
_started = 0
_watching = False


def compilations() -> int:
    """Compilations started since the count began (-1 before ``torch._dynamo`` was imported: nothing can
    have been compiled yet, and the first compilation imports it, so the count still moves)."""
    global _watching
    if not _watching:
        if "torch._dynamo" not in sys.modules:
            return -1
        with _lock:
            if not _watching:
                from torch._dynamo.callback import callback_handler

                callback_handler.register_start_callback(_started_one)
                _watching = True
    return _started


def _started_one(_: Any) -> None:
    global _started
    with _lock:
        _started += 1
