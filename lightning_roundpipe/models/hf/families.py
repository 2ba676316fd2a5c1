"""The architecture table: what each supported causal LM does that Llama's shape does not, as far as the
stages are concerned. One short entry per architecture; the stages read it.

Everything inside a block (the attention's biases, q/k norms, sinks, soft-capping and scaling, the MLP
or the mixture of experts, the norms' formulas) is the model's own code: a block runs as the model's
decoder layer. What the table says is what happens *around* the blocks (the embedding's multiplier,
which attention mask and rotary table each block gets, what the logits go through before the loss, where
the router is) and, for ``split_decoder_layers``, how a block's two halves are made of its modules.
Checked at build time: a block whose norms differ from the entry's layout, or a configuration switch the
table does not handle, is refused instead of trained with different arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

Norms = tuple[str | None, str | None]
"""The block's modules around one half: (the norm before it, the norm after it), ``None`` where there is none."""

PRE_NORM: tuple[Norms, Norms] = (("input_layernorm", None), ("post_attention_layernorm", None))
"""Llama's: ``h + attn(input_layernorm(h))``, then ``h + mlp(post_attention_layernorm(h))``."""
SANDWICH: tuple[Norms, Norms] = (
    ("input_layernorm", "post_attention_layernorm"),
    ("pre_feedforward_layernorm", "post_feedforward_layernorm"),
)
"""Gemma 2 and 3: a norm before and after each half."""
POST_NORM: tuple[Norms, Norms] = ((None, "post_attention_layernorm"), (None, "post_feedforward_layernorm"))
"""OLMo 2: ``h + post_attention_layernorm(attn(h))``, then ``h + post_feedforward_layernorm(mlp(h))``."""


class FamilyMismatch(ValueError):
    """The model is not what its family's entry describes (under ``hf_stages="auto"`` the generic path takes it)."""


@dataclass(frozen=True)
class Family:
    """How one architecture differs from Llama's shape (see the module docstring)."""

    halves: tuple[Norms, Norms] = PRE_NORM
    masks: str = "layer_types"
    """``"layer_types"``: ``config.layer_types`` says per block whether it attends through a sliding window
    (none: causal); ``"sliding_window"``: every block does when ``config.sliding_window`` is set;
    ``"causal"``: none does."""
    rotary_per_layer_type: bool = False
    """The rotary module takes the block's layer type (Gemma 3: local and global tables)."""
    embedding_multiplier: str | None = None
    """Config attribute the embedding's output is multiplied by outside ``embed_tokens`` (Granite)."""
    residual_multiplier: str | None = None
    """Config attribute both residual branches are multiplied by (Granite; for the split halves)."""
    residual_dropout: tuple[str, str] | None = None
    """The block's dropouts on the attention and MLP branches (Phi-3; for the split halves)."""
    logits_divisor: str | None = None
    """Config attribute the logits are divided by before the loss (Granite's ``logits_scaling``)."""
    logits_softcap: str | None = None
    """Config attribute of the soft cap on the logits, ``cap * tanh(logits / cap)`` (Gemma)."""
    router: str | None = None
    """Mixture of experts: the MLP's attribute holding the router, whose first output is the logits."""
    refuse: tuple[tuple[str, str], ...] = ()
    """(config attribute, why): settings of this family the stages do not reproduce, refused when true."""

    def sliding(self, config: Any, index: int) -> bool:
        """Whether block ``index`` attends through a sliding window."""
        if self.masks == "layer_types":
            types = getattr(config, "layer_types", None)
            return bool(types) and types[index] == "sliding_attention"
        return self.masks == "sliding_window" and getattr(config, "sliding_window", None) is not None

    def layer_type(self, config: Any, index: int) -> str | None:
        """Block ``index``'s layer type, for a rotary module that takes one."""
        return config.layer_types[index] if self.rotary_per_layer_type else None

    def multiplier(self, config: Any, attribute: str | None) -> float | None:
        value = None if attribute is None else getattr(config, attribute, None)
        return None if value is None or float(value) == 1.0 else float(value)

    def check(self, name: str, config: Any, layers: list[nn.Module]) -> None:
        """Refuse a model this entry would run with other arithmetic than its own."""
        for attribute, why in self.refuse:
            if getattr(config, attribute, False):
                raise FamilyMismatch(
                    f"roundpipe's {name} entry cannot pipeline it with `{attribute}` set: {why} (with hf_stages='auto'"
                    " and blocks not split, the generic path trains it with its own code)"
                )
        expected = {n for half in self.halves for n in half if n is not None}
        for i, layer in enumerate(layers):
            norms = {n for n, m in layer.named_children() if n.endswith("layernorm")}
            if norms != expected:
                raise FamilyMismatch(
                    f"roundpipe's {name} entry expects decoder blocks with the norms {sorted(expected)}, but block {i}"
                    f" has {sorted(norms)}: this model is not the architecture the entry describes (with"
                    " hf_stages='auto' and blocks not split, the generic path trains it with its own code)"
                )


MOE = "gate"

# fmt: off
FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(),
    "MistralForCausalLM": Family(masks="sliding_window"),
    "MixtralForCausalLM": Family(masks="sliding_window", router=MOE),
    "Qwen2ForCausalLM": Family(),
    "Qwen2MoeForCausalLM": Family(router=MOE),
    "Qwen3ForCausalLM": Family(),
    "Qwen3MoeForCausalLM": Family(router=MOE),
    "Gemma2ForCausalLM": Family(halves=SANDWICH, logits_softcap="final_logit_softcapping"),
    "Gemma3ForCausalLM": Family(
        halves=SANDWICH,
        rotary_per_layer_type=True,
        logits_softcap="final_logit_softcapping",
        refuse=(("use_bidirectional_attention", "its masks are not causal"),),
    ),
    "Phi3ForCausalLM": Family(masks="sliding_window", residual_dropout=("resid_attn_dropout", "resid_mlp_dropout")),
    "Olmo2ForCausalLM": Family(halves=POST_NORM, masks="causal"),
    "GraniteForCausalLM": Family(
        masks="causal",
        embedding_multiplier="embedding_multiplier",
        residual_multiplier="residual_multiplier",
        logits_divisor="logits_scaling",
    ),
    "GptOssForCausalLM": Family(router="router"),
}
# fmt: on
"""Architecture (the ``*ForCausalLM`` class name) to what its stages need; ``docs/architectures.md`` lists
what was tested."""
