"""Routes ``model(**batch)`` to the pipeline engine during training and evaluation steps."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from lightning_roundpipe.models.hf.attention import plain_inputs
from lightning_roundpipe.models.hf.detect import unwrap

FLATTENING_KEYWORDS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
"""What ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` or ``return_seq_idx=True`` adds next to the
position ids: the same sequences again (transformers' own SDPA path reads them from the positions too)."""


class Interceptor:
    """Routes the Hugging Face model's ``forward`` through the pipeline during training steps.

    ``run(inputs, target)`` is the engine call; outside training steps (validation, generation)
    the model's own forward runs on the host weights.
    """

    def __init__(
        self,
        model: nn.Module,
        run: Callable[[Any, Any], Tensor],
        active: Callable[[], bool],
        evaluating: Callable[[], bool] = lambda: False,
    ) -> None:
        self.model = unwrap(model)
        self._run = run
        self._active = active
        self._evaluating = evaluating
        self._warned_cache = False
        self._original = self.model.forward
        # token type ids, which tokenizers of some families return: a model whose forward does not name them
        # passes them down as keywords its layers ignore, and so do we
        self._ignores_token_types = "token_type_ids" not in inspect.signature(self._original).parameters
        self.model.forward = self  # an instance attribute: nn.Module.__call__ finds it first

    def __call__(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        labels: Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        # validation/test steps with labels: the loss through the pipeline (forward only); anything else
        # outside a training step (generation, logits for metrics) runs the model itself on the host
        if not self._active() and not (self._evaluating() and labels is not None):
            return self._original(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, labels=labels, **kwargs
            )
        if kwargs.pop("use_cache", False) and not self._warned_cache:
            self._warned_cache = True
            warnings.warn("roundpipe trains without a KV cache; `use_cache=True` is ignored", stacklevel=2)
        for key in ("past_key_values", "cache"):
            if kwargs.pop(key, None) is not None:
                raise ValueError(f"`{key}` cannot be used while training through roundpipe")
        kwargs = {k: v for k, v in kwargs.items() if v is not None and v is not False and k != "return_dict"}
        if self._ignores_token_types:
            kwargs.pop("token_type_ids", None)
        if position_ids is not None:  # the flattening collator's flash keywords say what the positions say
            for key in FLATTENING_KEYWORDS:
                kwargs.pop(key, None)
        if kwargs:
            hint = (
                " (a flattened batch's sequences are read from its position ids: keep the collator's"
                " return_position_ids=True)"
                if set(kwargs) & set(FLATTENING_KEYWORDS)
                else ""
            )
            raise ValueError(
                f"roundpipe's {type(self.model).__name__} preset takes input_ids, attention_mask, position_ids and"
                f" labels; got also {sorted(kwargs)}{hint}"
            )
        if input_ids is None:
            raise ValueError("roundpipe needs `input_ids` (inputs_embeds are not supported)")
        if labels is None:
            raise ValueError("roundpipe computes the loss inside the pipeline: pass `labels`")
        attention_mask, position_ids = plain_inputs(attention_mask, position_ids)
        loss = self._run((input_ids, attention_mask, position_ids, labels), labels)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return CausalLMOutputWithPast(loss=loss)

    def restore(self) -> None:
        if self.model.__dict__.get("forward") is self:
            del self.model.forward
