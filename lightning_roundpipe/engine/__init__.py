"""The engine: runs whole batches through the pipeline and calls its collaborators at batch boundaries.

``pipeline.py`` holds :class:`PipelineEngine`, which dispatches batches; ``crew.py`` the threads and
their failures; ``planner.py`` the automatic plan; ``steps.py`` the optimizer steps and their ordering;
``evaluation.py`` forward-only passes; ``stats.py`` what recorded batches measured; ``state.py`` the
engine's part of a checkpoint. The engine builds on :mod:`lightning_roundpipe.runtime` (the data plane)
and :mod:`lightning_roundpipe.schedule` (pure logic); nothing there imports it.
"""

from lightning_roundpipe.engine.pipeline import PipelineEngine
from lightning_roundpipe.engine.steps import DOUBLE_BUFFERS, double_buffering

__all__ = ["DOUBLE_BUFFERS", "PipelineEngine", "double_buffering"]
