"""4-bit base weights (QLoRA): bitsandbytes' ``Linear4bit`` layers run on a worker's tensors.

A layer loaded with ``BitsAndBytesConfig(load_in_4bit=True)`` keeps its weight packed (two 4-bit codes per byte,
``uint8``) and its quantization state (the blocks' scales, the code book and, with double quantization, the
scales' own scales) as plain attributes of the weight. The host store and the workers' weight-less replicas see
only the packed weight; the state would stay on the host, and bitsandbytes' ``forward`` rebuilds it from the
module when the weight it is handed has none. :func:`prepare` makes the state's tensors buffers of the layer
(non-persistent: the state dict is unchanged) and gives the layer an instance ``forward`` that builds the
quantization state from them and calls ``bitsandbytes.matmul_4bit``, as the class's ``forward`` does. So the
packed weight and its state are stored once on the host (a frozen ``uint8`` group: never cast, never
dequantized there), uploaded packed, and dequantized by the 4-bit kernel on the worker; only the adapters (and
anything else trainable) get gradients, masters and optimizer states. :func:`remove` undoes it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

_BUFFERS = ("absmax", "code", "offset", "absmax2", "code2")
_PREFIX = "roundpipe_4bit_"


@dataclass(frozen=True)
class _Layout:
    """The plain part of a layer's quantization state (the tensors are its buffers)."""

    shape: torch.Size
    blocksize: int
    quant_type: str
    dtype: torch.dtype
    nested: bool
    blocksize2: int = 0
    dtype2: torch.dtype = torch.float32


def four_bit_layers(model: nn.Module) -> list[nn.Module]:
    """The model's bitsandbytes 4-bit linear layers (none when bitsandbytes was never imported: no model holds
    its layers then)."""
    if "bitsandbytes" not in sys.modules:
        return []
    from bitsandbytes.nn import Linear4bit

    return [m for m in model.modules() if isinstance(m, Linear4bit)]


def refuse_8bit(model: nn.Module) -> None:
    """An 8-bit base (``load_in_8bit``) keeps its scales in attributes this path does not carry: a clear error
    instead of layers that would lose them on the worker."""
    if "bitsandbytes" not in sys.modules:
        return
    from bitsandbytes.nn import Linear8bitLt

    found = [name for name, m in model.named_modules() if isinstance(m, Linear8bitLt)]
    if found:
        raise ValueError(
            f"roundpipe runs 4-bit base weights (BitsAndBytesConfig(load_in_4bit=True)), not 8-bit ones: the model"
            f" holds {len(found)} bitsandbytes Linear8bitLt layers (e.g. {found[0]}). Load it with load_in_4bit=True"
            " (QLoRA), or unquantized."
        )


def prepare(model: nn.Module) -> int:
    """Make each 4-bit layer of ``model`` carry its quantization state as buffers and run through
    :func:`_forward`; returns how many layers. Checked: a layer whose weight is not quantized yet (never moved
    to a device or loaded quantized) is refused."""
    layers, seen = four_bit_layers(model), set()
    for layer in layers:
        if hasattr(layer, "_roundpipe_4bit"):
            continue
        state = getattr(layer.weight, "quant_state", None) or getattr(layer, "quant_state", None)
        if state is None or layer.weight.dtype.is_floating_point:
            raise ValueError(
                f"a bitsandbytes {type(layer).__name__} layer is not quantized yet (its weight is {layer.weight.dtype}"
                " with no quantization state): load the model with BitsAndBytesConfig(load_in_4bit=True), or"
                " quantize the layer, before training"
            )
        nested = state.state2 is not None
        layer._roundpipe_4bit = _Layout(
            state.shape, int(state.blocksize), state.quant_type, state.dtype, nested,
            int(state.state2.blocksize) if nested else 0, state.state2.dtype if nested else torch.float32,
        )  # fmt: skip
        tensors = {"absmax": state.absmax, "code": state.code}
        if nested:
            tensors.update(offset=torch.as_tensor(state.offset), absmax2=state.state2.absmax, code2=state.state2.code)
        for name, tensor in tensors.items():  # a code book shared between layers: each layer its own copy
            tensors[name] = tensor.clone() if id(tensor) in seen else tensor
            seen.add(id(tensors[name]))
        state.absmax, state.code = tensors["absmax"], tensors["code"]  # the state and the buffers: one tensor each
        if nested:
            state.offset, state.state2.absmax = tensors["offset"], tensors["absmax2"]
            state.state2.code = tensors["code2"]
        for name, tensor in tensors.items():
            layer.register_buffer(_PREFIX + name, tensor, persistent=False)
        layer.forward = _forward.__get__(layer)
    return len(layers)


def remove(model: nn.Module) -> None:
    """The 4-bit layers run their class's ``forward`` again, without the buffers (their tensors stay the weight's
    quantization state)."""
    for layer in four_bit_layers(model):
        if not hasattr(layer, "_roundpipe_4bit"):
            continue
        del layer._roundpipe_4bit
        layer.__dict__.pop("forward", None)
        for name in _BUFFERS:
            layer._buffers.pop(_PREFIX + name, None)


def _forward(self: Any, x: Tensor) -> Tensor:
    """``Linear4bit.forward`` on the quantization state held in buffers (on a replica: the slot's device
    tensors), without bitsandbytes' in-place repacking for CPU inference or casting of the bias."""
    import bitsandbytes as bnb
    from bitsandbytes.functional import QuantState

    layout: _Layout = self._roundpipe_4bit
    buffers = self._buffers
    state2 = None
    if layout.nested:
        state2 = QuantState(
            absmax=buffers[_PREFIX + "absmax2"], code=buffers[_PREFIX + "code2"], blocksize=layout.blocksize2,
            dtype=layout.dtype2,
        )  # fmt: skip
    state = QuantState(
        absmax=buffers[_PREFIX + "absmax"], shape=layout.shape, code=buffers[_PREFIX + "code"],
        blocksize=layout.blocksize, quant_type=layout.quant_type, dtype=layout.dtype,
        offset=buffers[_PREFIX + "offset"] if layout.nested else None, state2=state2,
    )  # fmt: skip
    dtype = x.dtype
    compute = self.compute_dtype or dtype
    bias = None if self.bias is None else self.bias.to(compute)
    return bnb.matmul_4bit(x.to(compute), self.weight, bias=bias, quant_state=state).to(dtype)


def packed_bytes(model: nn.Module) -> int:
    """Bytes of the 4-bit layers' packed weights and quantization states (what the host holds for them)."""
    total = 0
    for layer in four_bit_layers(model):
        total += layer.weight.numel() * layer.weight.element_size()
        state = getattr(layer.weight, "quant_state", None)
        if state is not None:
            parts = [state.absmax, state.code]
            if state.state2 is not None:
                parts += [state.state2.absmax, state.state2.code]
            total += sum(t.numel() * t.element_size() for t in parts if isinstance(t, Tensor))
    return total


def _is_base(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def _base_prefixes(module: nn.Module) -> tuple[str, ...]:
    """State-dict keys of the 4-bit layers' packed weights and their quantization state (``<layer>.weight...``)."""
    if "bitsandbytes" not in sys.modules:
        return ()
    from bitsandbytes.nn import Linear4bit

    return tuple(f"{name}.weight" for name, m in module.named_modules() if isinstance(m, Linear4bit))


def without_base(state_dict: dict[str, Any], module: nn.Module) -> dict[str, Any]:
    """A checkpoint's model state without the 4-bit base weights: they are what the model was loaded with, and
    the adapters are what training changes (a 70B base would add 35 GB to every checkpoint)."""
    prefixes = _base_prefixes(module)
    if not prefixes:
        return state_dict
    return type(state_dict)((k, v) for k, v in state_dict.items() if not _is_base(k, prefixes))


def load_without_base(module: nn.Module, state_dict: Any, strict: bool = True) -> None:
    """``module.load_state_dict`` for a checkpoint written by :func:`without_base`: the 4-bit base weights stay as
    loaded (a checkpoint that holds them anyway has them skipped); everything else as strict as asked."""
    prefixes = _base_prefixes(module)
    if not prefixes:
        module.load_state_dict(state_dict, strict=strict)
        return
    result = module.load_state_dict({k: v for k, v in state_dict.items() if not _is_base(k, prefixes)}, strict=False)
    missing = [k for k in result.missing_keys if not _is_base(k, prefixes)]
    if strict and (missing or result.unexpected_keys):
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(module).__name__}: missing keys {missing[:5]}, unexpected"
            f" keys {result.unexpected_keys[:5]} (the 4-bit base weights are not part of roundpipe's checkpoints)"
        )
