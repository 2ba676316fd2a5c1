"""Hugging Face causal LMs as layer sequences, so ``self.model(**batch).loss`` trains unchanged.

Two ways of cutting a causal LM into an input stage (token embedding), one stage per decoder block and an
output stage (final norm, LM head, loss): the architecture table's (``families``, ``presets``,
``stages``: what happens around the blocks re-implemented per family, with split blocks, tiles and
Liger's kernels), and the generic path (``anatomy``, ``generic``, ``shells``: the model's own ``forward``
run around its blocks over stand-ins, for any decoder whose base model keeps its blocks in a
``ModuleList``, checked against the model on a probe batch). What crosses a stage boundary is
``(hidden_states, attention_mask, position_ids, labels, router_sums)``: the 2-D padding mask, never an
O(seq^2) one, and, for mixture-of-experts models with ``output_router_logits``, the running per-expert
sums the load-balancing loss is made of. Each stage makes the masks and rotary tables its blocks need
from them, once per micro-batch. Parameters stay the model's own, so tied input/output embeddings
remain one parameter with one gradient.

Other modules: ``attention`` (the table's masks and rotary tables, ``plain_inputs``), ``router``
(load-balancing sums), ``labels``, ``state`` (the boundary type), ``detect`` (``is_hf_model``,
``unwrap``), ``kernels`` (Liger's) and ``interceptor`` (``model(**batch)`` to the engine). Only
``transformers`` is imported, and only inside functions, when a Hugging Face model is pipelined: the
core package does not need it.
"""

from lightning_roundpipe.models.hf import kernels
from lightning_roundpipe.models.hf.attention import plain_inputs
from lightning_roundpipe.models.hf.detect import is_hf_model, unwrap
from lightning_roundpipe.models.hf.families import FAMILIES, Family
from lightning_roundpipe.models.hf.interceptor import Interceptor
from lightning_roundpipe.models.hf.labels import IGNORE_INDEX, counted_tokens, shift_labels
from lightning_roundpipe.models.hf.packed import check_packable, packable, require_flash
from lightning_roundpipe.models.hf.presets import PATHS, PRESETS, build_layers, decoder_layers, pipeline_layers
from lightning_roundpipe.models.hf.stages import AttentionStage, DecoderStage, InputStage, MlpStage, OutputStage
from lightning_roundpipe.models.hf.state import State
from lightning_roundpipe.models.hf.tokens import TokenSplit

__all__ = [
    "FAMILIES",
    "IGNORE_INDEX",
    "PATHS",
    "PRESETS",
    "AttentionStage",
    "DecoderStage",
    "Family",
    "InputStage",
    "Interceptor",
    "MlpStage",
    "OutputStage",
    "State",
    "TokenSplit",
    "build_layers",
    "check_packable",
    "counted_tokens",
    "decoder_layers",
    "is_hf_model",
    "kernels",
    "packable",
    "pipeline_layers",
    "plain_inputs",
    "require_flash",
    "shift_labels",
    "unwrap",
]
