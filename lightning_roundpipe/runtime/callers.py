"""Where a warning should point: the first frame outside this package, however deep it is raised."""

from __future__ import annotations

import sys


def outside_package() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside this package (the user's
    code or Lightning's), from the function that calls this one."""
    frame, level = sys._getframe(1), 1  # the function that warns
    while frame is not None and frame.f_globals.get("__name__", "").startswith("lightning_roundpipe"):
        frame, level = frame.f_back, level + 1
    return level
