"""Long runs stay flat (resident memory, threads) and runs are reproducible bit for bit."""

from __future__ import annotations

import threading

import lightning as L
import psutil
import pytest
import torch
from helpers import BoringPipeline, boring_data, fit, flat_weights
from test_checkpoint import DropoutPipeline

from lightning_roundpipe import RoundPipeStrategy


class Gauge(L.Callback):
    def __init__(self) -> None:
        self.rss: list[int] = []
        self.threads: list[int] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        self.rss.append(psutil.Process().memory_info().rss)
        self.threads.append(threading.active_count())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("async_optimizer", [False, True])
def test_500_steps_keep_memory_and_threads_flat(async_optimizer):
    gauge = Gauge()
    trainer = L.Trainer(
        strategy=RoundPipeStrategy(num_microbatches=3, async_optimizer=async_optimizer), accelerator="cpu",
        devices=2, max_steps=500, logger=False, enable_progress_bar=False, enable_checkpointing=False,
        enable_model_summary=False, callbacks=[gauge],
    )  # fmt: skip
    trainer.fit(BoringPipeline(), boring_data(samples=96 * 8))
    assert len(gauge.rss) == 500
    assert len(set(gauge.threads[20:])) == 1, "threads started or leaked during training"
    grown = max(gauge.rss[100:]) - gauge.rss[100]
    assert grown < 16 * 2**20, f"resident memory grew by {grown / 2**20:.1f} MiB between steps 100 and 500"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "module, async_optimizer", [(DropoutPipeline, False), (BoringPipeline, False), (BoringPipeline, True)]
)
def test_same_seed_gives_bit_identical_weights(module, async_optimizer):
    def run():
        strategy = RoundPipeStrategy(num_microbatches=3, async_optimizer=async_optimizer)
        return flat_weights(fit(module, {"accelerator": "cpu", "devices": 2, "strategy": strategy, "max_epochs": 2}))

    first, second = run(), run()
    assert torch.equal(first, second)
    L.seed_everything(1, verbose=False)  # the seed `fit` starts from
    assert not torch.equal(first, flat_weights(module()))  # it trained
