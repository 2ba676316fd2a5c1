"""Hugging Face causal LMs as layer sequences, so ``self.model(**batch).loss`` trains unchanged.

A preset turns a supported ``*ForCausalLM`` into: an input stage (token embedding), one stage per
decoder block, and an output stage (final norm, LM head, chunked loss). What crosses a stage boundary
is ``(hidden_states, attention_mask, position_ids, labels, router_sums)``: the 2-D padding mask, never
an O(seq^2) one, and, for mixture-of-experts models with ``output_router_logits``, the running
per-expert sums the load-balancing loss is made of. Each block builds the attention mask its
implementation needs with transformers' public ``create_causal_mask`` (called positionally: its cache
argument was renamed between releases) and its rotary tables from the position ids. Parameters stay
the model's own, so tied input/output embeddings remain one parameter with one gradient.

Modules: ``presets`` (the architecture table, ``build_layers``), ``stages``, ``attention`` (masks,
rotary tables, ``plain_inputs``), ``router`` (load-balancing sums), ``labels``, ``state`` (the
boundary type), ``detect`` (``is_hf_model``, ``unwrap``) and ``interceptor`` (``model(**batch)`` to
the engine). Only ``transformers`` is imported, and only inside functions, when a Hugging Face model
is pipelined: the core package does not need it.
"""

from lightning_roundpipe.models.hf import kernels
from lightning_roundpipe.models.hf.attention import plain_inputs
from lightning_roundpipe.models.hf.detect import is_hf_model, unwrap
from lightning_roundpipe.models.hf.families import FAMILIES, Family
from lightning_roundpipe.models.hf.interceptor import Interceptor
from lightning_roundpipe.models.hf.labels import IGNORE_INDEX, counted_tokens, shift_labels
from lightning_roundpipe.models.hf.presets import PRESETS, build_layers, decoder_layers
from lightning_roundpipe.models.hf.stages import AttentionStage, DecoderStage, InputStage, MlpStage, OutputStage
from lightning_roundpipe.models.hf.state import State

__all__ = [
    "FAMILIES",
    "IGNORE_INDEX",
    "PRESETS",
    "AttentionStage",
    "DecoderStage",
    "Family",
    "InputStage",
    "Interceptor",
    "MlpStage",
    "OutputStage",
    "State",
    "build_layers",
    "counted_tokens",
    "decoder_layers",
    "is_hf_model",
    "kernels",
    "plain_inputs",
    "shift_labels",
    "unwrap",
]
