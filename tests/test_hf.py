"""Hugging Face presets: ``self.model(**batch).loss`` trains through the pipeline with the model's numbers."""

from __future__ import annotations

import copy
import os

import lightning as L
import pytest
import torch
from helpers import relative_error
from torch.utils.data import DataLoader

transformers = pytest.importorskip("transformers")

from lightning_roundpipe import RoundPipeStrategy  # noqa: E402
from lightning_roundpipe.engine import PipelineEngine  # noqa: E402
from lightning_roundpipe.models import hf  # noqa: E402
from lightning_roundpipe.runtime import WorkerDevice  # noqa: E402
from lightning_roundpipe.schedule import StagePlan  # noqa: E402

VOCAB = 101


def tiny(arch: str, attn: str = "sdpa", tied: bool = True, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied, attn_implementation=attn,
    )  # fmt: skip
    if arch == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=8, **common))


def padded_batch(rows: int = 6, length: int = 10, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (rows, length), generator=g)
    attention_mask = torch.ones_like(input_ids)
    for r, pad in enumerate([0, 3, 0, 5, 1, 0][:rows]):  # right padding of different lengths
        if pad:
            attention_mask[r, -pad:] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def engine_loss_and_grads(model, batch, workers=2, plan=None, mbs=3, split=False, tile_tokens=None):
    layers = hf.build_layers(model, split_decoder_layers=split, tile_tokens=tile_tokens)
    engine = PipelineEngine(
        layers, [WorkerDevice("cpu", i) for i in range(workers)], plan=plan, microbatches_per_round=mbs
    )
    try:
        ids = batch["input_ids"]
        pos = batch.get("position_ids", torch.arange(ids.shape[1]).expand_as(ids))
        mask, pos = hf.plain_inputs(batch.get("attention_mask"), pos)  # as the Interceptor does
        inputs = (ids, mask, pos, batch["labels"])
        loss = engine.train_batch(inputs, batch["labels"], lambda out, _: out, reduction=hf.counted_tokens)
        engine.store.install_grads()
        return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    finally:
        engine.close()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("split", [False, True])
def test_loss_and_gradients_equal_the_model_run_directly(arch, attn, tied, split):
    model = tiny(arch, attn, tied)
    reference = copy.deepcopy(model)
    batch = padded_batch()
    # 5 layers (embedding, 3 blocks, head), or 8 with each block split in two: forward and backward
    # partitions differ, and with the split, stages end inside blocks
    plan = StagePlan.parse("3,3|2,3,3" if split else "2,1|2,1,2")
    loss, grads = engine_loss_and_grads(model, batch, plan=plan, split=split)
    want = reference(**batch)
    want.loss.backward()
    assert relative_error(loss, want.loss.detach()) <= 1e-5
    expected = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        assert relative_error(grad, expected[name]) <= 1e-5, name
    if tied:  # one parameter, one gradient holding both uses
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert "lm_head.weight" not in grads


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_layers_tiled_over_tokens_give_the_model_run_directly(arch):
    """Each micro-batch holds 20 tokens; tiles of 7 make three tiles per MLP and input-norm call, in
    forward stages (no autograd) and in backward stages (recomputed tile by tile)."""
    assert_equals_the_model_run_directly(tiny(arch), plan=StagePlan.parse("3,3|2,3,3"), split=True, tile_tokens=7)


def test_tiled_layers_keep_less_for_backward():
    """The MLP layer keeps only its input; the attention layer no longer keeps its input norm's fp32
    intermediates (in this fp32 model, the normalised hidden states; in bf16 also the fp32 copy)."""
    model = tiny("qwen3")
    hidden = torch.randn(1, 48, 32, requires_grad=True)
    positions = torch.arange(48)[None]

    def saved_bytes(kind, tile_tokens):
        stage = next(s for s in hf.build_layers(model, True, tile_tokens) if isinstance(s, kind))
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen, total = set(weights), [0]

        def pack(t):
            if t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total[0] += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            stage((hidden, None, positions, None, None))
        return total[0]

    whole, tiles = saved_bytes(hf.MlpStage, None), saved_bytes(hf.MlpStage, 16)
    assert tiles == hidden.numel() * 4  # the input, once
    assert whole > 5 * tiles  # norm output, gate, up, activation, product
    whole, tiles = saved_bytes(hf.AttentionStage, None), saved_bytes(hf.AttentionStage, 16)
    assert whole - tiles >= hidden.numel() * 4


def test_mlp_tiling_needs_the_split_and_refuses_what_it_cannot_replay():
    model = tiny("qwen3")
    with pytest.raises(ValueError, match="split_decoder_layers=True"):
        hf.build_layers(model, split_decoder_layers=False, tile_tokens=8)
    with pytest.raises(ValueError, match="split_decoder_layers=True"):
        RoundPipeStrategy(tile_tokens=8)
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["gate_proj", "down_proj"], lora_dropout=0.1))
    (stage, *_) = [s for s in hf.build_layers(lora, True, 4) if isinstance(s, hf.MlpStage)]
    with pytest.raises(ValueError, match="lora_dropout=0"):
        stage((torch.randn(1, 9, 32, requires_grad=True), None, None, None, None))


def test_plain_inputs_drop_masks_and_positions_that_say_nothing():
    ones, positions = torch.ones(2, 5, dtype=torch.long), torch.arange(5).expand(2, 5)
    assert hf.plain_inputs(ones, positions) == (None, None)
    padded = ones.clone()
    padded[1, -2:] = 0
    packed = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]])
    mask, pos = hf.plain_inputs(padded, packed)
    assert mask is padded and pos is packed
    mask, pos = hf.plain_inputs(ones, packed)  # next to packed positions a mask of ones still means something
    assert mask is ones and pos is packed


@pytest.mark.parametrize("packed", [False, True])
def test_unpadded_and_packed_batches_equal_the_model_run_directly(packed):
    model = tiny("qwen3")
    reference = copy.deepcopy(model)
    batch = padded_batch()
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    batch["labels"] = batch["input_ids"].clone()
    if packed:  # two documents per row, as sequence packing without padding makes them
        batch["position_ids"] = torch.cat([torch.arange(4), torch.arange(6)]).expand_as(batch["input_ids"])
        del batch["attention_mask"]
    loss, grads = engine_loss_and_grads(model, batch, plan=StagePlan.parse("2,1|2,1,2"))
    want = reference(**batch, use_cache=False)  # with a cache, transformers ignores the packing
    want.loss.backward()
    assert relative_error(loss, want.loss.detach()) <= 1e-5
    for name, p in reference.named_parameters():
        assert relative_error(grads[name], p.grad) <= 1e-5, name
    if packed:  # the packing changed the numbers: the block-diagonal mask was applied
        plain = copy.deepcopy(reference)
        del batch["position_ids"]
        assert relative_error(plain(**batch, use_cache=False).loss.detach(), want.loss.detach()) > 1e-4


class HFModule(L.LightningModule):
    def __init__(self, arch: str = "qwen3", tied: bool = True):
        super().__init__()
        self.model = tiny(arch, tied=tied)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def hf_data(batches: int = 4) -> DataLoader:
    items = [padded_batch(seed=s) for s in range(batches)]
    return DataLoader(items, batch_size=None)


def fit_hf(strategy, devices, arch="qwen3", tied=True, **trainer_kwargs):
    L.seed_everything(0, verbose=False)
    module = HFModule(arch, tied)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **trainer_kwargs,
    )  # fmt: skip
    trainer.fit(module, hf_data())
    return module


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_training_step_unchanged_weights_equal_plain_lightning(arch):
    plain = fit_hf("auto", 1, arch)
    ours = fit_hf(RoundPipeStrategy(num_microbatches=3, async_optimizer=False), 2, arch)
    flat = lambda m: torch.cat([p.detach().flatten() for p in m.parameters()])  # noqa: E731
    assert relative_error(flat(ours), flat(plain)) <= 1e-5
    assert relative_error(flat(ours), flat(HFModule(arch))) > 1e-3  # it trained
    assert "forward" not in ours.model.__dict__  # the interception is undone at teardown


@pytest.mark.parametrize("split", [False, True])
def test_bf16_true_hugging_face_model_equals_plain_lightning_bf16_true(split):
    """A Hugging Face model in ``precision="bf16-true"``: bf16 parameters and optimizer states, and with one
    micro-batch the weights of plain Lightning's bf16-true (bf16 rounding), whole or split blocks."""
    plain = fit_hf("auto", 1, precision="bf16-true")
    strategy = RoundPipeStrategy(num_microbatches=1, async_optimizer=False, split_decoder_layers=split)
    ours = fit_hf(strategy, 1, precision="bf16-true")
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    flat = lambda m: torch.cat([p.detach().float().flatten() for p in m.parameters()])  # noqa: E731
    assert relative_error(flat(ours), flat(plain)) <= 3e-2  # the chunked loss's fp32 logits; the fused AdamW
    assert relative_error(flat(ours), flat(HFModule("qwen3"))) > 0.1  # it trained


@pytest.mark.parametrize("tile_tokens", [None, 4])
def test_split_decoder_layers_through_the_strategy_equal_plain_lightning(monkeypatch, tile_tokens):
    built = []
    build = hf.pipeline_layers
    monkeypatch.setattr(hf, "pipeline_layers", lambda *args: built.append(build(*args)[0]) or (built[-1], ""))
    plain = fit_hf("auto", 1, "qwen3")
    strategy = RoundPipeStrategy(
        num_microbatches=3, async_optimizer=False, split_decoder_layers=True, tile_tokens=tile_tokens
    )
    ours = fit_hf(strategy, 2, "qwen3")
    assert [len(layers) for layers in built] == [2 + 2 * 3]  # embedding, 3 blocks in halves, head
    assert {layer.tile_tokens for layer in built[0][1:-1]} == {tile_tokens}
    flat = lambda m: torch.cat([p.detach().flatten() for p in m.parameters()])  # noqa: E731
    assert relative_error(flat(ours), flat(plain)) <= 1e-5


def test_a_split_block_keeps_about_half_the_activations_per_stage():
    """What one stage must hold for its backward bounds the longest sequence: split, the larger half of a
    block keeps well under the whole block's (measured by the engine's own profiling)."""
    kept = {}
    for split in (False, True):
        model = tiny("qwen3")
        layers = hf.build_layers(model, split_decoder_layers=split)
        engine = PipelineEngine(layers, [WorkerDevice("cpu", 0)], plan="auto", profile_steps=1)
        try:
            batch = padded_batch(rows=2, length=48)
            inputs = (batch["input_ids"], batch["attention_mask"], None, batch["labels"])
            engine.train_batch(inputs, batch["labels"], lambda out, _: out, reduction=hf.counted_tokens)
            assert engine.planner.layer_costs is not None
            kept[split] = max(engine.planner.layer_costs.backward_activations[1:-1])  # the decoder layers
        finally:
            engine.close()
    assert kept[True] <= 0.65 * kept[False], kept


@pytest.mark.parametrize("variant", ["sliding-window", "moe-with-a-dense-layer"])
def test_split_blocks_of_sliding_window_and_mixed_moe_models_equal_the_model_run_directly(variant):
    torch.manual_seed(0)
    if variant == "sliding-window":  # layers 1 and 2 attend within a window of 4
        config = transformers.Qwen3Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, use_sliding_window=True, sliding_window=4, max_window_layers=1,
            attn_implementation="sdpa",
        )  # fmt: skip
        assert "sliding_attention" in config.layer_types
        model = transformers.Qwen3ForCausalLM(config)
    else:
        model = tiny_moe(aux=True, mlp_only_layers=[0])
    assert_equals_the_model_run_directly(model, workers=1, mbs=1, split=True)  # (aux loss of the whole batch)


def test_padded_batches_skip_transformers_device_check_for_the_causal_shortcut(monkeypatch):
    """With padding in the mask, SDPA's ``is_causal`` shortcut cannot apply, and testing the mask for it
    on the GPU costs a host sync per block: the stages tell transformers not to (same numbers, see the
    padded-batch tests above)."""
    from transformers import masking_utils

    calls = []
    real = masking_utils.create_causal_mask

    def spy(*args, allow_is_causal_skip=True, **kwargs):  # the flag in the signature, as transformers has it
        calls.append(allow_is_causal_skip)
        return real(*args, allow_is_causal_skip=allow_is_causal_skip, **kwargs)

    monkeypatch.setattr(masking_utils, "create_causal_mask", spy)
    layers = hf.build_layers(tiny("qwen3"))
    ids = torch.randint(0, VOCAB, (2, 8))
    for mask, want in ((torch.tensor([[1] * 8, [1] * 5 + [0] * 3]), False), (None, True)):
        calls.clear()
        state = layers[0]((ids, mask, None, ids))
        for layer in layers[1:-1]:
            state = layer(state)
        assert calls == [want]  # made by the first block, shared by the three


def test_blocks_share_a_micro_batchs_attention_inputs_and_each_model_keeps_its_own(monkeypatch):
    """The mask, positions and rotary tables are made by the first block a micro-batch meets in a stage and
    shared by the blocks after it (made in every block they cost a sixth of a block's forward on the
    host). A micro-batch's pass is told by its labels, a new tensor at every upload: the next pass (also
    while the last one's labels live on, as autograd may keep them), another length or another model make
    their own, a rotary module changed in between is read again, and nothing is held once the passes'
    labels are gone."""
    from lightning_roundpipe.models.hf import attention

    made = []
    real = attention._make_attention_inputs
    monkeypatch.setattr(attention, "_make_attention_inputs", lambda *args: made.append(1) or real(*args))

    kept = []

    def blocks(layers, ids, mask=None, fresh=False):
        kept.append(ids.clone())  # the labels as an upload brings them (new), kept alive for a while
        state = layers[0]((ids, mask, None, kept[-1]))
        for layer in layers[1:-1]:
            if fresh:  # every block makes its own, as before they were shared
                attention._RECENT.made = {}
            state = layer(state)
        return state[0]

    first = tiny("qwen3")
    second = tiny("qwen3", seed=1)
    second.config.rope_parameters = {**second.config.rope_parameters, "rope_theta": 10.0}
    second.model.rotary_emb = type(second.model.rotary_emb)(second.config)  # other tables, same shapes
    assert not torch.equal(first.model.rotary_emb.inv_freq, second.model.rotary_emb.inv_freq)
    ids = torch.randint(0, VOCAB, (2, 8))
    plain = [blocks(hf.build_layers(copy.deepcopy(m)), ids, fresh=True) for m in (first, second)]
    assert len(made) == 6
    made.clear()
    layers = [hf.build_layers(m) for m in (first, second)]
    with torch.no_grad():
        assert torch.equal(blocks(layers[0], ids), plain[0]) and len(made) == 1  # three blocks, made once
        assert torch.equal(blocks(layers[1], ids), plain[1]) and len(made) == 2
        assert torch.equal(blocks(layers[0], ids), plain[0]) and len(made) == 3  # the next micro-batch's own
        blocks(layers[0], ids[:, :6])
        blocks(layers[0], ids, torch.tensor([[1] * 8, [1] * 5 + [0] * 3]))
        assert len(made) == 5
        kept.clear()
        assert not getattr(attention._RECENT, "made", {})  # let go with the passes' labels
        first.model.rotary_emb.inv_freq.mul_(0.25)  # e.g. a schedule stretching the context, between batches
        changed = blocks(layers[0], ids)
    reference = copy.deepcopy(first)
    assert torch.equal(changed, blocks(hf.build_layers(reference), ids, fresh=True))
    assert relative_error(changed, plain[0]) > 1e-3


def test_a_rotary_module_changed_between_batches_reaches_the_workers():
    """A schedule that changes the rope between batches (here the frequencies, in place, as the host store's
    views carry them to the workers): the next batch's tables are made from the new ones."""
    model = tiny("qwen3")
    engine = PipelineEngine(
        hf.build_layers(model), [WorkerDevice("cpu", i) for i in range(2)], plan=StagePlan.parse("2,1|2,1,2"),
        microbatches_per_round=3,
    )  # fmt: skip
    ids = torch.randint(0, VOCAB, (6, 10), generator=torch.Generator().manual_seed(0))
    try:
        before = engine.evaluate((ids, None, None, ids), ids, lambda out, _: out, reduction=hf.counted_tokens)
        with torch.no_grad():
            model.model.rotary_emb.inv_freq.mul_(0.25)
        after = engine.evaluate((ids, None, None, ids), ids, lambda out, _: out, reduction=hf.counted_tokens)
    finally:
        engine.close()
    want = copy.deepcopy(model)(input_ids=ids, labels=ids).loss
    assert relative_error(after, want.detach()) <= 1e-5 and relative_error(before, after) > 1e-5


def test_a_preset_of_one_argument_still_works_and_cannot_split(monkeypatch):
    """Presets registered as ``preset(model)`` keep working; asking them to split is a clear error."""
    model = tiny("qwen3")
    monkeypatch.setitem(hf.PRESETS, "Qwen3ForCausalLM", lambda m: hf.decoder_layers(m))
    assert len(hf.build_layers(model)) == 2 + 3
    with pytest.raises(ValueError, match=r"Qwen3ForCausalLM preset cannot split.*`split` keyword"):
        hf.build_layers(model, split_decoder_layers=True)


def test_use_cache_warns_and_missing_labels_is_an_error():
    class NoLabels(HFModule):
        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch["input_ids"], use_cache=True).loss

    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(strategy="roundpipe", accelerator="cpu", devices=2, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
    with pytest.warns(UserWarning, match="without a KV cache"), pytest.raises(ValueError, match="pass `labels`"):
        trainer.fit(NoLabels(), hf_data())


def test_core_package_does_not_import_transformers_or_peft(tmp_path, prewarmed):
    """The presets are imported only when a Hugging Face model is pipelined; nothing else imports them. (The
    import runs in a process of its own that starts with torch and Lightning imported: ``prewarmed``.)"""
    import ast
    from pathlib import Path

    import lightning_roundpipe

    root = Path(lightning_roundpipe.__file__).parent
    script = tmp_path / "imports.py"
    script.write_text("import sys, lightning_roundpipe\nassert 'lightning_roundpipe.models.hf' not in sys.modules\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root.parent), os.environ.get("PYTHONPATH", "")])}
    proc = prewarmed[0].popen([script], env=env, cwd=tmp_path, stdout=tmp_path / "out.txt")
    log, _ = proc.communicate(timeout=100)
    assert proc.returncode == 0, log[-3000:]
    for path in root.rglob("*.py"):  # models/hf/ too: its transformers imports are inside functions
        for node in ast.parse(path.read_text()).body:  # module-level imports only
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] in ("transformers", "peft") for n in names), path


peft = pytest.importorskip("peft")


class LoRAModule(L.LightningModule):
    def __init__(self):
        super().__init__()
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
        self.model = peft.get_peft_model(tiny("qwen3"), config)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)  # frozen parameters included, as users do


def fit_lora(strategy, devices, **trainer_kwargs):
    L.seed_everything(0, verbose=False)
    module = LoRAModule()
    start = {n: p.detach().clone() for n, p in module.named_parameters()}
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **trainer_kwargs,
    )  # fmt: skip
    trainer.fit(module, hf_data())
    return module, start, trainer.optimizers[0]


@pytest.mark.parametrize("async_optimizer", [False, True])
def test_lora_trains_only_adapters(async_optimizer):
    ours, start, optimizer = fit_lora(RoundPipeStrategy(num_microbatches=3, async_optimizer=async_optimizer), 2)
    adapters = {n: p for n, p in ours.named_parameters() if p.requires_grad}
    frozen = {n: p for n, p in ours.named_parameters() if not p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    for name, p in frozen.items():
        assert torch.equal(p, start[name]), f"{name} changed"
    assert not any(p in optimizer.state for p in frozen.values())  # no state for frozen parameters
    assert all(optimizer.state[p] for p in adapters.values())
    if not async_optimizer:
        plain, _, _ = fit_lora("auto", 1)
        for name, p in adapters.items():
            assert relative_error(p.detach(), dict(plain.named_parameters())[name].detach()) <= 1e-5, name
    else:
        assert any(not torch.equal(p, start[n]) for n, p in adapters.items())


def test_lora_under_bf16_true_trains_only_adapters_in_bf16():
    ours, start, optimizer = fit_lora(RoundPipeStrategy(num_microbatches=3), 2, precision="bf16-true")
    adapters = {n: p for n, p in ours.named_parameters() if p.requires_grad}
    assert adapters and all(p.dtype == torch.bfloat16 for p in ours.parameters())
    frozen = [(p, start[n].to(p.dtype)) for n, p in ours.named_parameters() if not p.requires_grad]
    assert frozen and all(torch.equal(p, before) for p, before in frozen)  # as they were (in bf16)
    assert any(not torch.equal(p, start[n].to(p.dtype)) for n, p in adapters.items())
    assert all(
        t.dtype == torch.bfloat16 for p in adapters.values() for k, t in optimizer.state[p].items() if k != "step"
    )


def test_lora_frozen_weights_take_two_bytes_on_the_host_in_bf16():
    model = peft.get_peft_model(tiny("qwen3"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    engine = PipelineEngine(hf.build_layers(model), [WorkerDevice("cpu", 0)], compute_dtype=torch.bfloat16)
    try:
        frozen = [g for g in engine.store.groups if g.kind == "frozen"]
        trainable = [g for g in engine.store.groups if g.kind == "trainable"]
        assert frozen and all(g.grad is None and g.data.dtype == torch.bfloat16 and g.compute is g.data for g in frozen)
        assert all(g.grad is not None and g.data.dtype == torch.float32 for g in trainable)
        frozen_params = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        frozen_bytes = sum(g.data.numel() * g.data.element_size() for g in frozen if g.params == [])
        assert frozen_bytes <= 2 * frozen_params + 64 * 1024  # (buffers such as rotary tables aside)
    finally:
        engine.close()


def tiny_moe(aux: bool, seed: int = 0, **extra) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(**extra,
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, output_router_logits=aux, router_aux_loss_coef=0.5, tie_word_embeddings=False,
        attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # routers start at zero: give them something to route with
        for name, p in model.named_parameters():
            if "gate" in name and p.dim() == 2 and p.shape[0] == 4:
                p.normal_(0, 0.5)
    return model


def assert_equals_the_model_run_directly(model: torch.nn.Module, **engine_kwargs) -> None:
    """The engine's loss and every gradient equal the Hugging Face model's own on a padded batch."""
    reference = copy.deepcopy(model)
    batch = padded_batch()
    loss, grads = engine_loss_and_grads(model, batch, **engine_kwargs)
    want = reference(**batch)
    want.loss.backward()
    assert relative_error(loss, want.loss.detach()) <= 1e-5
    expected = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert grads.keys() == expected.keys()
    for name, grad in expected.items():
        assert relative_error(grads[name], grad) <= 1e-5, name


def test_moe_without_aux_loss_equals_the_whole_batch_run():
    assert_equals_the_model_run_directly(tiny_moe(aux=False))


def test_tiled_moe_layers_equal_the_model_run_directly_and_aux_losses_refuse_tiles():
    assert_equals_the_model_run_directly(tiny_moe(aux=False), split=True, tile_tokens=7)  # 3 tiles per call
    layers = hf.build_layers(tiny_moe(aux=True), split_decoder_layers=True, tile_tokens=7)
    stage = next(s for s in layers if isinstance(s, hf.MlpStage))
    sums = torch.zeros(4)
    with pytest.raises(ValueError, match="output_router_logits"):
        stage((torch.randn(1, 20, 32), None, None, None, sums))


def test_tiled_layers_in_bf16_through_the_engine_stay_within_bf16_of_untiled():
    batch = padded_batch()
    results = []
    for tile_tokens in (None, 7):
        model = tiny("qwen3")
        layers = hf.build_layers(model, split_decoder_layers=True, tile_tokens=tile_tokens)
        engine = PipelineEngine(
            layers, [WorkerDevice("cpu", i) for i in range(2)], plan=StagePlan.parse("3,3|2,3,3"),
            microbatches_per_round=3, compute_dtype=torch.bfloat16, autocast_dtype=torch.bfloat16,
        )  # fmt: skip
        try:
            inputs = (batch["input_ids"], *hf.plain_inputs(batch["attention_mask"], None), batch["labels"])
            loss = engine.train_batch(inputs, batch["labels"], lambda out, _: out, reduction=hf.counted_tokens)
            engine.store.install_grads()
            results.append((loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        finally:
            engine.close()
    (loss, grads), (tiled_loss, tiled_grads) = results
    assert relative_error(tiled_loss, loss) <= 1e-2
    assert tiled_grads.keys() == grads.keys()
    for name, grad in grads.items():
        assert relative_error(tiled_grads[name], grad) <= 2e-2, name


@pytest.mark.parametrize("split", [False, True])
def test_moe_aux_loss_is_the_models_own_per_micro_batch(split):
    """With output_router_logits the loss includes router_aux_loss_coef x the load-balancing loss of each
    micro-batch (as with gradient accumulation); routers get its gradient through every stage."""
    model = tiny_moe(aux=True)
    reference = copy.deepcopy(model)
    batch = padded_batch()
    loss, grads = engine_loss_and_grads(model, batch, mbs=3, split=split)
    parts = [{k: v[i : i + 2] for k, v in batch.items()} for i in (0, 2, 4)]
    counts = [hf.counted_tokens(p["labels"]).item() for p in parts]
    want = sum(reference(**p).loss * (c / sum(counts)) for p, c in zip(parts, counts))
    want.backward()
    assert relative_error(loss, want.detach()) <= 1e-5
    router_grads = [n for n, p in reference.named_parameters() if "gate" in n and p.grad is not None and p.dim() == 2]
    assert router_grads
    for name, p in reference.named_parameters():
        if p.grad is not None:
            assert relative_error(grads[name], p.grad) <= 1e-5, name


class HFValidated(HFModule):
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(**batch).loss)


def test_validation_loss_through_the_pipeline_equals_the_model_run_directly(monkeypatch):
    calls = []
    original = PipelineEngine.evaluate
    monkeypatch.setattr(PipelineEngine, "evaluate", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    module = HFValidated()
    plain_module = copy.deepcopy(module)
    kwargs = dict(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    got = L.Trainer(strategy=RoundPipeStrategy(num_microbatches=3), devices=2, **kwargs).validate(module, hf_data())
    want = L.Trainer(devices=1, **kwargs).validate(plain_module, hf_data())
    assert got[0]["val_loss"] == pytest.approx(want[0]["val_loss"], rel=1e-5)
    assert len(calls) == 4  # every batch went through the pipeline
    assert "forward" not in module.model.__dict__


def test_trained_model_saves_with_save_pretrained_and_loads_back(tmp_path):
    module = fit_hf(RoundPipeStrategy(num_microbatches=3), 2)
    module.model.save_pretrained(tmp_path)  # the one call after training: weights are plain tensors again
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    want = module.model.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, want[name]), name


def test_validation_with_logits_from_the_host_model_when_asked():
    class WithLogits(HFModule):
        def validation_step(self, batch, batch_idx):
            out = self.model(**batch)
            self.log("val_loss", out.loss)
            self.log("val_acc", (out.logits.argmax(-1) == batch["input_ids"]).float().mean())

    module = WithLogits()
    plain_module = copy.deepcopy(module)
    kwargs = dict(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    strategy = RoundPipeStrategy(num_microbatches=3, evaluate_hf_in_pipeline=False)
    got = L.Trainer(strategy=strategy, devices=2, **kwargs).validate(module, hf_data())[0]
    want = L.Trainer(devices=1, **kwargs).validate(plain_module, hf_data())[0]
    assert got["val_acc"] == pytest.approx(want["val_acc"]) and got["val_loss"] == pytest.approx(want["val_loss"])


class CheckpointedHFModule(HFModule):
    def __init__(self, arch: str = "qwen3", tied: bool = True):
        super().__init__(arch, tied)
        self.model.gradient_checkpointing_enable()  # a common memory recipe, written before roundpipe was chosen


def test_a_model_with_its_own_gradient_checkpointing_trains_as_plain_lightning():
    """Its layers' own recompute ran after their weights had left the worker ('not on the expected device meta'):
    roundpipe recomputes each stage already, so the model's is off while it trains and on again after."""
    L.seed_everything(0, verbose=False)
    plain = CheckpointedHFModule()
    trainer = lambda **kw: L.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,  # noqa: E731
                                     enable_progress_bar=False, enable_model_summary=False, **kw)  # fmt: skip
    trainer(devices=1).fit(plain, hf_data())
    L.seed_everything(0, verbose=False)
    ours = CheckpointedHFModule()
    trainer(devices=2, strategy=RoundPipeStrategy(num_microbatches=3, async_optimizer=False)).fit(ours, hf_data())
    flat = lambda m: torch.cat([p.detach().flatten() for p in m.parameters()])  # noqa: E731
    assert relative_error(flat(ours), flat(plain)) <= 1e-5
    assert all(layer.gradient_checkpointing for layer in ours.model.model.layers)  # the user's setting is back
