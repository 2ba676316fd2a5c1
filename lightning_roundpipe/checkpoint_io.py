"""Checkpoint files written straight to disk, atomically.

Lightning's default ``TorchCheckpointIO`` first serialises the whole checkpoint into memory and then
writes it out: for a model whose states already fill host memory (the point of roundpipe) that
copy can be the largest allocation of the run. Here ``torch.save`` streams into a temporary file
next to the target, which is flushed, synced and renamed over the target only when complete: a
crash while saving leaves the previous checkpoint untouched and no partial file under its name.
Remote paths (``s3://``, ...) go through Lightning's own writer.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from typing_extensions import override

from lightning_roundpipe._flavor import lightning_package

pl = lightning_package(globals())


def _is_local(path: Any) -> bool:
    return "://" not in str(path) or str(path).startswith("file://")


class StreamingCheckpointIO(pl.plugins.TorchCheckpointIO):  # type: ignore[misc,name-defined]
    """``TorchCheckpointIO`` that writes local files through a temporary file and a rename."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or not _is_local(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        target = Path(str(path).removeprefix("file://"))
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        try:
            os.chmod(tmp, 0o666 & ~_umask())  # as a plain open() would make it (mkstemp's file is private: 0600)
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _umask() -> int:
    """The process's file-creation mask (read by setting it, then put back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
