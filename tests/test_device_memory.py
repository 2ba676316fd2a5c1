"""GPU memory readings while the engine profiles layers: the per-action resets of PyTorch's peak counter
must not hide a peak from whoever else reads it. Runs without a GPU on a stand-in counter; the GPU test
in ``test_gpu.py`` reads the real one."""

from __future__ import annotations

import pytest
import torch

from lightning_roundpipe.runtime import device as device_module
from lightning_roundpipe.runtime.device import CudaWorkerDevice, max_memory_allocated, reset_peak_memory_stats


class Counter:
    """PyTorch's allocated/peak counters of one device, as the functions the engine calls see them."""

    def __init__(self) -> None:
        self.allocated = self.peak = 0

    def allocate(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)

    def reset(self, device=None) -> None:
        self.peak = self.allocated


@pytest.fixture
def counter(monkeypatch):
    c = Counter()
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: c.allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: c.peak)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", c.reset)
    monkeypatch.setattr(device_module, "_CLEARED_PEAKS", {})
    return c


def test_a_peak_before_a_profiling_reset_is_still_read(counter):
    dev = CudaWorkerDevice("cuda:0", 0)
    reset_peak_memory_stats(0)
    counter.allocate(10 << 30)  # a step's peak ...
    counter.allocate(-9 << 30)
    mark = dev.memory_mark()  # ... then the profiling measures one action
    counter.allocate(2 << 30)
    assert dev.memory_peak_since(mark) == 2 << 30  # the action's own peak, as before
    assert torch.cuda.max_memory_allocated(0) == 3 << 30  # what PyTorch alone now says
    assert max_memory_allocated(0) == max_memory_allocated("cuda:0") == 10 << 30  # what the step really held
    counter.allocate(8 << 30)
    assert max_memory_allocated(0) == 11 << 30  # a later, higher peak counts as usual
    reset_peak_memory_stats("cuda:0")
    assert max_memory_allocated(0) == 11 << 30  # still allocated now
    counter.allocate(-10 << 30)
    reset_peak_memory_stats(0)
    assert max_memory_allocated(0) == 1 << 30  # the record is gone with the reset


def test_the_record_is_per_device(counter):
    dev = CudaWorkerDevice("cuda:1", 0)
    counter.allocate(4 << 30)
    counter.allocate(-4 << 30)
    dev.memory_mark()
    assert max_memory_allocated(1) == 4 << 30
    assert max_memory_allocated(0) == 0  # the shared fake counter reads 0 here; device 0 has no record


@pytest.mark.parametrize(
    ("env", "switched"),
    [({}, True), ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, False),
     ({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}, False),
     ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}, True)],
)  # fmt: skip
def test_expandable_segments_are_switched_on_unless_the_allocator_settings_say_either_way(monkeypatch, env, switched):
    """Micro-batches of changing sizes fragment the default caching allocator (an H200 reserved 138.7 GiB for a
    60 GiB peak); a user's own setting of the flag is kept."""
    from lightning_roundpipe.runtime import device

    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    asked: list[str] = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", asked.append)
    assert device.expandable_segments() is switched
    assert asked == (["expandable_segments:True"] if switched else [])
