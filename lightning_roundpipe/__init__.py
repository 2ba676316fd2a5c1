"""lightning-roundpipe: a PyTorch Lightning strategy for training models larger than GPU memory.

Importing the package registers ``"roundpipe"`` with Lightning's strategy registry (and with
``pytorch_lightning``'s when that package is installed), so ``Trainer(strategy="roundpipe")`` works.
"""

from lightning_roundpipe._flavor import is_installed, twin
from lightning_roundpipe.api import pipeline_forward, pipeline_loss
from lightning_roundpipe.callbacks import RoundPipeMonitor
from lightning_roundpipe.memory import HostMemoryEstimate, estimate_host_memory
from lightning_roundpipe.precision import RoundPipePrecision
from lightning_roundpipe.schedule import StagePlan
from lightning_roundpipe.strategy import RoundPipeStrategy

__version__ = "0.1.0"
__all__ = [
    "HostMemoryEstimate",
    "RoundPipeMonitor",
    "RoundPipePrecision",
    "RoundPipeStrategy",
    "StagePlan",
    "estimate_host_memory",
    "pipeline_forward",
    "pipeline_loss",
]


def _register() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    RoundPipeStrategy.register_strategies(StrategyRegistry)
    if is_installed("pytorch_lightning"):
        import sys

        import pytorch_lightning.strategies

        twin_strategy = twin(sys.modules[RoundPipeStrategy.__module__], "pytorch_lightning")
        twin_strategy.RoundPipeStrategy.register_strategies(pytorch_lightning.strategies.StrategyRegistry)


_register()
