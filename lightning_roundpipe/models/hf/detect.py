"""Which modules are Hugging Face models, and the model inside a ``peft`` wrapper."""

from __future__ import annotations

from torch import nn


def unwrap(module: nn.Module) -> nn.Module:
    """The Hugging Face model inside a ``peft`` wrapper (``PeftModel.base_model.model``), else itself."""
    base = getattr(module, "base_model", None)
    inner = getattr(base, "model", None)
    if base is not None and inner is not None and type(module).__module__.startswith("peft"):
        return inner
    return module


def is_hf_model(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers ``PreTrainedModel`` or a peft wrapper of one."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(unwrap(module), PreTrainedModel)
