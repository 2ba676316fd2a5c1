"""The data plane: host store, worker devices and threads, stage execution and the pipeline engine."""

from lightning_roundpipe.runtime.device import WorkerDevice, layer_seed
from lightning_roundpipe.runtime.engine import PipelineEngine
from lightning_roundpipe.runtime.host_store import HostStore
from lightning_roundpipe.runtime.microbatch import Reduction

__all__ = ["HostStore", "PipelineEngine", "Reduction", "WorkerDevice", "layer_seed"]
