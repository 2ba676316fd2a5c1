"""The data plane: host store and buffers, worker devices and threads, stage execution, the optimizer thread."""

from lightning_roundpipe.runtime.device import WorkerDevice, layer_seed
from lightning_roundpipe.runtime.host_store import HostStore
from lightning_roundpipe.runtime.microbatch import Reduction

__all__ = ["HostStore", "Reduction", "WorkerDevice", "layer_seed"]
