"""The generic path: any decoder-only causal LM trains with the model's own code around its blocks. Every
architecture here has no entry in the table, and each of the table's is forced through it too: loss and every
gradient against the model run directly (fp32, padded batches with -100 labels, two workers, three
micro-batches, forward and backward partitions that differ); LoRA, a mixture of experts with its
load-balancing loss, and through ``Trainer`` against plain Lightning with batches of a new length every
step and packed rows. What the stages cannot carry is refused, naming it."""

from __future__ import annotations

import copy
import logging

import lightning as L
import pytest
import torch
from helpers import relative_error
from test_architectures import COMMON, CONFIGS, MOE, assert_equals_the_model_run_directly, tiny
from test_hf import VOCAB, padded_batch
from torch.utils.data import DataLoader

transformers = pytest.importorskip("transformers")

from lightning_roundpipe import RoundPipeStrategy  # noqa: E402
from lightning_roundpipe.models import hf  # noqa: E402
from lightning_roundpipe.models.hf.generic import GenericBlock, GenericInput, GenericOutput  # noqa: E402

DEEPSEEK = dict(
    q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_routed_experts=4,
    num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=16, first_k_dense_replace=1,
    n_shared_experts=1, num_key_value_heads=4,
)  # fmt: skip
THREE_TYPES = dict(sliding_window=4, layer_types=["sliding_attention", "full_attention", "sliding_attention"])

GENERIC: dict[str, tuple[str, str, dict]] = {
    # the architectures issue 38 names, none in the table: (config class, model class, what the config sets)
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(logit_scale=0.5)),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(partial_rotary_factor=0.5, qk_layernorm=True)),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", dict(head_dim=8)),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", THREE_TYPES),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", THREE_TYPES),
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", dict(head_dim=8, attention_dropout=0.0, residual_dropout=0.0)),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(sliding_window=4, residual_dropout=0.0)),
    "nemotron": ("NemotronConfig", "NemotronForCausalLM", dict(head_dim=8, partial_rotary_factor=0.5)),
    "helium": ("HeliumConfig", "HeliumForCausalLM", dict(head_dim=8)),
    "apertus": ("ApertusConfig", "ApertusForCausalLM", {}),
    "arcee": ("ArceeConfig", "ArceeForCausalLM", {}),
    "ministral3": ("Ministral3Config", "Ministral3ForCausalLM", dict(head_dim=8, sliding_window=4)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(output_router_logits=True, **DEEPSEEK)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, **MOE)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(
        n_embd=32, n_layer=3, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )),
}  # fmt: skip


def generic_model(arch: str, **extra) -> torch.nn.Module:
    config_name, model_name, settings = GENERIC[arch]
    if not hasattr(transformers, model_name):
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**{**COMMON, **settings, **extra})
    if hasattr(config, "experts_implementation"):
        config.experts_implementation = "eager"
    return getattr(transformers, model_name)(config)


@pytest.mark.parametrize("arch", sorted(GENERIC))
def test_every_architecture_without_an_entry_takes_the_generic_path_with_the_models_numbers(arch):
    model = generic_model(arch)
    layers, how = hf.pipeline_layers(copy.deepcopy(model))
    assert how.startswith(f"{type(model).__name__} takes the generic path (its class has no entry")
    assert isinstance(layers[0], GenericInput) and isinstance(layers[-1], GenericOutput)
    assert all(isinstance(layer, GenericBlock) for layer in layers[1:-1]) and len(layers) == 2 + 3
    assert_equals_the_model_run_directly(model, split=False)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_every_table_family_forced_through_the_generic_path_equals_the_model_run_directly(arch):
    assert_equals_the_model_run_directly(tiny(arch), split=False, path="generic")


def test_the_loss_takes_the_fastest_way_that_gives_the_models_own():
    """A plain head and the standard loss: chunked cross-entropy on the head's input, which the model's constant
    logit scale (Cohere's ``logit_scale``, Granite's ``logits_scaling``) multiplies. Logits soft-capped (Gemma):
    the model's code over tiles of tokens. A loss that is not per token: the model's own, over whole logits."""
    built = {
        "llama": hf.pipeline_layers(tiny("llama"), path="generic"),
        "granite": hf.pipeline_layers(tiny("granite"), path="generic"),
        "gemma2": hf.pipeline_layers(tiny("gemma2"), path="generic"),
        "cohere": hf.pipeline_layers(generic_model("cohere")),
    }
    modes = {arch: (layers[-1].mode, layers[-1].scale) for arch, (layers, _) in built.items()}
    assert modes == {
        "llama": ("chunked", None), "granite": ("chunked", 0.25), "gemma2": ("tiled", None), "cohere": ("chunked", 0.5)
    }  # fmt: skip
    assert "the logits scaled by 0.5" in built["cohere"][1] and "over tiles of tokens" in built["gemma2"][1]

    class Normalised(transformers.LlamaForCausalLM):  # logits minus their mean over the sequence: not per token
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **{**kwargs, "labels": None})
            logits = out.logits - out.logits.mean(dim=1, keepdim=True)
            labels = kwargs.get("labels")
            out.loss = None if labels is None else self.loss_function(logits, labels, self.config.vocab_size)
            return out

    model = Normalised(tiny("llama").config)
    layers, how = hf.pipeline_layers(model)
    assert layers[-1].mode == "model" and "the model's own loss over whole logits" in how
    assert_equals_the_model_run_directly(model, split=False)


@pytest.mark.parametrize("arch", ["cohere", "deepseek_v3"])
def test_lora_on_generic_families_equals_the_model_run_directly(arch):
    peft = pytest.importorskip("peft")
    targets = "all-linear" if arch == "cohere" else ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"]
    model = peft.get_peft_model(generic_model(arch), peft.LoraConfig(r=4, target_modules=targets, lora_dropout=0.0))
    assert_equals_the_model_run_directly(model, split=False)


def test_a_mixture_of_experts_adds_its_load_balancing_loss_from_router_sums_where_the_model_does():
    """OLMoE adds ``router_aux_loss_coef`` times the load-balancing loss: carried as router sums (checked
    against the model's own function on a probe at build time). DeepSeek-V3 asks for router logits and adds
    none: no sums travel."""
    _, how = hf.pipeline_layers(generic_model("olmoe"))
    assert "load-balancing loss from router sums (coefficient 0.1)" in how
    layers, how = hf.pipeline_layers(generic_model("deepseek_v3"))
    assert "load-balancing" not in how and layers[0].num_experts == 0
    assert [layer.sparse for layer in layers[1:-1]] == [False, True, True]  # dense first block, then experts
    assert [bool(layer.compile_targets()) for layer in layers[1:-1]] == [True, False, False]


# ----------------------------------------------------------------------------------- through the Trainer
def varying_batches(steps: int = 4, rows: int = 6, packed: bool = False) -> DataLoader:
    """Padded batches of a new length every step, prompts labelled -100; or rows packed with two documents
    each (positions restarting at 0, no padding mask), as a flattening collator makes them."""
    items = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        length = 7 + 2 * step
        input_ids = torch.randint(3, VOCAB, (rows, length), generator=g)
        if packed:
            split = 3 + step
            positions = torch.cat([torch.arange(split), torch.arange(length - split)]).expand(rows, -1).clone()
            labels = input_ids.clone()
            labels[:, split] = -100  # no next-token target across the documents' border
            items.append({"input_ids": input_ids, "position_ids": positions, "labels": labels})
            continue
        pads = torch.randint(0, length // 2, (rows,), generator=g)
        attention_mask = (torch.arange(length) < (length - pads)[:, None]).long()
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        labels[:, :2] = -100  # the prompt
        items.append({"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels})
    return DataLoader(items, batch_size=None)


class GenericModule(L.LightningModule):
    def __init__(self, arch: str):
        super().__init__()
        self.model = generic_model(arch)

    def training_step(self, batch, batch_idx):
        return self.model(**batch, use_cache=False).loss  # with a cache, transformers ignores the packing

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(**batch).loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def fit_generic(strategy, devices, arch, data, val=None):
    L.seed_everything(0, verbose=False)
    module = GenericModule(arch)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, data, val)
    return module, trainer


@pytest.mark.parametrize(("arch", "packed"), [("cohere", False), ("starcoder2", False), ("helium", True)])
def test_training_through_the_generic_path_equals_plain_lightning(arch, packed, caplog):
    """Four steps of batches of a new length each (or packed rows), two workers, three micro-batches,
    synchronous: the weights equal plain Lightning's; the log says which path the model took."""
    plain, _ = fit_generic("auto", 1, arch, varying_batches(packed=packed))
    with caplog.at_level(logging.INFO):
        strategy = RoundPipeStrategy(num_microbatches=3, async_optimizer=False)
        ours, trainer = fit_generic(strategy, 2, arch, varying_batches(packed=packed), varying_batches(1))
    assert any("takes the generic path" in r.getMessage() for r in caplog.records)
    flat = lambda m: torch.cat([p.detach().flatten() for p in m.parameters()])  # noqa: E731
    assert relative_error(flat(ours), flat(plain)) <= 1e-5
    assert relative_error(flat(ours), flat(GenericModule(arch))) > 1e-3  # it trained
    assert torch.isfinite(trainer.callback_metrics["val_loss"])


# ----------------------------------------------------------------------------------------- what is refused
class Reading(transformers.LlamaModel):
    """Hands every block the embeddings too (a value-residual design): the stages do not carry them."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, **kwargs):
        kwargs.pop("use_cache", None)
        inputs_embeds = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        position_ids = torch.arange(inputs_embeds.shape[1])[None] if position_ids is None else position_ids
        rotary = self.rotary_emb(inputs_embeds, position_ids)
        hidden = inputs_embeds
        for layer in self.layers:
            hidden = layer(hidden, position_embeddings=rotary, first=inputs_embeds, **kwargs)
        return transformers.modeling_outputs.BaseModelOutputWithPast(last_hidden_state=self.norm(hidden))


class Tokens(transformers.LlamaModel):
    """Hands every block the token ids: a stage has only the hidden states."""

    def forward(self, input_ids=None, inputs_embeds=None, **kwargs):
        inputs_embeds = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rotary = self.rotary_emb(inputs_embeds, torch.arange(inputs_embeds.shape[1])[None])
        hidden = inputs_embeds
        for layer in self.layers:
            hidden = layer(hidden, position_embeddings=rotary, tokens=input_ids)
        return transformers.modeling_outputs.BaseModelOutputWithPast(last_hidden_state=self.norm(hidden))


class Cached(transformers.LlamaModel):
    """Passes its blocks a cache, whatever ``use_cache`` says."""

    def forward(self, *args, **kwargs):
        kwargs["use_cache"], kwargs["cache"] = True, transformers.DynamicCache(config=self.config)
        return super().forward(*args, **kwargs)


@pytest.mark.parametrize(
    ("base", "message"),
    [
        (Reading, r"block 0 is handed the embeddings \(as `first`\)"),
        (Tokens, r"block 0's `tokens` depends on the token ids"),
        (Cached, r"block 0 is handed a cache \(`(cache|past_key_values)`\) that persists across blocks"),
    ],
)
def test_what_the_stages_cannot_carry_is_refused_naming_it(base, message):
    model = tiny("llama")
    model.model = base(model.config)
    with pytest.raises(ValueError, match=rf"cannot pipeline LlamaForCausalLM through its generic path: {message}"):
        hf.build_layers(model, path="generic")


def test_encoder_decoders_nested_block_lists_and_table_only_requests_are_refused():
    torch.manual_seed(0)
    t5 = transformers.T5ForConditionalGeneration(
        transformers.T5Config(vocab_size=VOCAB, d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8)
    )
    with pytest.raises(ValueError, match="it is an encoder-decoder"):
        hf.build_layers(t5)
    opt = transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
        word_embed_proj_dim=32,
    ))  # fmt: skip
    with pytest.raises(ValueError, match=r"its base model \(OPTModel\) keeps no `ModuleList` of decoder blocks"):
        hf.build_layers(opt)
    with pytest.raises(ValueError, match=r"no entry for CohereForCausalLM; it has .*'LlamaForCausalLM'.*'auto'"):
        hf.build_layers(generic_model("cohere"), path="table")
    with pytest.raises(ValueError, match=r"split_decoder_layers=True .*takes the generic path.* blocks run whole"):
        hf.build_layers(generic_model("cohere"), split_decoder_layers=True)
    with pytest.raises(ValueError, match=r"hf_stages='everything'\) must be one of"):
        RoundPipeStrategy(hf_stages="everything")


def test_a_micro_batchs_block_arguments_are_made_once_per_stage():
    """The model's forward runs over stand-ins once per micro-batch and stage: the blocks after a stage's
    first reuse what it recorded, and a new micro-batch (new labels) records again."""
    layers = hf.build_layers(generic_model("cohere"))
    runs = []
    shell = layers[1].shell
    original = type(shell).forward
    for layer in layers[1:-1]:
        layer.shell.forward = lambda *a, _f=original, _s=layer.shell, **k: runs.append(1) or _f(_s, *a, **k)
    batch = padded_batch(rows=2)
    with torch.no_grad():
        state = layers[0]((batch["input_ids"], batch["attention_mask"], None, batch["labels"]))
        for layer in layers[1:-1]:
            state = layer(state)
        assert len(runs) == 1
        state = layers[1]((state[0], state[1], state[2], state[3].clone(), state[4]))
    assert len(runs) == 2


@pytest.mark.timeout(120)
def test_compiled_generic_blocks_equal_the_model_run_directly():
    """What ``compile="auto"`` does on a GPU, traced here by dynamo (``aot_eager``): each block compiles whole
    with the arguments the model's forward hands it (on the GPU: ``test_gpu.py``, Inductor)."""
    assert_equals_the_model_run_directly(generic_model("cohere"), split=False, compile=True)


def test_the_models_own_code_follows_its_training_mode():
    """Starcoder2 drops out of its embeddings in its own ``forward`` (``training=self.training``): in eval mode
    the first stage is the model's block input exactly, in training mode it is dropped out as the model's."""
    model = generic_model("starcoder2", embedding_dropout=0.5)
    layers = hf.build_layers(model)
    batch = padded_batch(rows=2)
    seen = []
    model.model.layers[0].register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    model.eval()
    with torch.no_grad():
        model(**batch)
        mine = layers[0]((batch["input_ids"], batch["attention_mask"], None, batch["labels"]))[0]
    assert torch.equal(mine, seen[0])
    model.train()
    with torch.no_grad():
        dropped = layers[0]((batch["input_ids"], batch["attention_mask"], None, batch["labels"]))[0]
    assert (dropped == 0).float().mean() > 0.3 and not torch.equal(dropped, seen[0])


def test_without_padding_the_block_arguments_are_made_once_per_shape_and_again_when_the_rope_changes():
    """No padding mask and plain positions: the arguments depend on the shape alone, so every stage and
    micro-batch of a worker shares one recording (transformers' packed-positions check waits for the device
    each time it runs); another length, a rotary module changed in place, or a preamble with trainable
    weights (GPT-2's position embedding) record again."""
    from lightning_roundpipe.models.hf import generic

    def count(layers):
        runs = []
        for layer in layers[1:-1]:
            original = type(layer.shell).forward
            layer.shell.forward = lambda *a, _f=original, _s=layer.shell, **k: runs.append(1) or _f(_s, *a, **k)
        return runs

    def blocks(layers, ids):
        state = layers[0]((ids, None, None, ids.clone()))  # a new labels tensor: a new pass
        for layer in layers[1:-1]:
            state = layer(state)
        return state[0]

    generic._RECENT.made = {}
    model = generic_model("cohere")
    layers = hf.build_layers(model)
    runs = count(layers)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        first = blocks(layers, ids)
        assert torch.equal(blocks(layers, ids), first) and len(runs) == 1  # two passes, every block: made once
        blocks(layers, ids[:, :6])
        assert len(runs) == 2
        model.model.rotary_emb.inv_freq.mul_(0.25)
        changed = blocks(layers, ids)
        assert len(runs) == 3 and not torch.equal(changed, first)
        assert torch.equal(changed, blocks(hf.build_layers(copy.deepcopy(model)), ids))
    gpt2 = hf.build_layers(generic_model("gpt2"))
    assert gpt2[1].watched is None and layers[1].watched is not None
    runs = count(gpt2)
    with torch.no_grad():
        blocks(gpt2, ids), blocks(gpt2, ids)
    assert len(runs) == 2  # once per pass: its position embedding is trained


def test_logits_over_tiles_give_the_models_gradients(monkeypatch):
    """Gemma's soft-capped logits go through the model's own code tile by tile, each tile recomputed in
    backward: tiles of 3 of a micro-batch's 20 tokens give the model's loss and gradients."""
    from lightning_roundpipe.models.hf import assembly

    monkeypatch.setattr(assembly, "CHUNK_TOKENS", 3)
    assert_equals_the_model_run_directly(tiny("gemma2"), split=False, path="generic")


def test_a_learned_logit_scale_runs_in_the_models_own_code_and_is_trained():
    """A causal LM with a tensor of its own (a learned temperature on the logits): on the probe it is a constant
    factor, but only the model's code applies its later values, and only there it gets a gradient."""

    class Tempered(transformers.LlamaForCausalLM):
        def __init__(self, config):
            super().__init__(config)
            self.temperature = torch.nn.Parameter(torch.tensor(0.5))

        def forward(self, *args, labels=None, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * self.temperature
            out.loss = None if labels is None else self.loss_function(out.logits, labels, self.config.vocab_size)
            return out

    torch.manual_seed(0)
    model = Tempered(tiny("llama").config)
    layers, how = hf.pipeline_layers(copy.deepcopy(model))
    assert layers[-1].mode == "tiled" and "holds tensors besides its base model and head" in how
    assert_equals_the_model_run_directly(model, split=False)  # the temperature's gradient included


def test_the_probe_leaves_the_model_in_its_mode_through_its_own_train():
    """transformers' ``train`` may do more than set flags (kernels chosen for training): the probe's eval mode
    is undone by calling it, and every module's flag is as it was."""
    calls = []

    class Moded(transformers.LlamaForCausalLM):
        def train(self, mode=True):
            calls.append(mode)
            return super().train(mode)

    model = Moded(tiny("llama").config)
    model.train()
    model.model.layers[1].eval()  # a user's own mix of modes
    flags = [m.training for m in model.modules()]
    calls.clear()
    hf.build_layers(model, path="generic")
    assert calls == [False, True] and [m.training for m in model.modules()] == flags


def test_a_model_dispatched_by_accelerate_is_refused():
    model = tiny("llama")
    model.model.layers[0]._hf_hook = object()  # what accelerate's dispatch_model leaves on each module
    with pytest.raises(ValueError, match=r"dispatched by accelerate \(hooks on model.layers.0.*without a device_map"):
        hf.build_layers(model)
