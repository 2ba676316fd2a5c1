"""Every architecture of the table (``models.hf.FAMILIES``) trains through the pipeline with the model's own
numbers: tiny random configs, padded batches with -100 labels, fp32, synchronous; the loss and every
gradient equal the Hugging Face model run directly, with whole blocks and with split ones, mixtures of
experts with their load-balancing loss, and once with LoRA adapters. An architecture this transformers
release lacks is skipped with the reason."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import relative_error
from test_hf import VOCAB, padded_batch

transformers = pytest.importorskip("transformers")

from lightning_roundpipe.engine import PipelineEngine  # noqa: E402
from lightning_roundpipe.models import compiled, hf  # noqa: E402
from lightning_roundpipe.runtime import WorkerDevice  # noqa: E402
from lightning_roundpipe.runtime.compiles import compilations  # noqa: E402
from lightning_roundpipe.schedule import StagePlan  # noqa: E402

COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
MOE = dict(output_router_logits=True, router_aux_loss_coef=0.1, num_experts_per_tok=2)
GEMMA = dict(head_dim=8, query_pre_attn_scalar=8, sliding_window=4, attn_implementation="eager")

CONFIGS: dict[str, tuple[str, str, dict]] = {
    # architecture: (config class, model class, what the tiny config sets beyond COMMON)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=4)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(sliding_window=4, num_local_experts=4, **MOE)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32, mlp_only_layers=[1], **MOE,
    )),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=8)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(head_dim=8, num_experts=4, moe_intermediate_size=32,
                                                                **MOE)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(final_logit_softcapping=5.0, **GEMMA)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        final_logit_softcapping=5.0, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        **GEMMA,
    )),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=4)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(
        embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=4.0, attention_multiplier=0.3,
    )),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        head_dim=8, sliding_window=4, num_local_experts=4, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        attn_implementation="eager", **MOE,
    )),
}  # fmt: skip


def tiny(arch: str) -> torch.nn.Module:
    config_name, model_name, extra = CONFIGS[arch]
    if not hasattr(transformers, model_name):
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**{**COMMON, **extra})
    if hasattr(config, "experts_implementation"):
        config.experts_implementation = "eager"
    return getattr(transformers, model_name)(config)


def assert_equals_the_model_run_directly(
    model: torch.nn.Module, split: bool, tile_tokens: int | None = None, tolerance: float = 1e-5, compile: bool = False,
    path: str = "auto",
) -> None:  # fmt: skip
    reference = copy.deepcopy(model)
    batch = padded_batch()
    layers = hf.build_layers(model, split_decoder_layers=split, tile_tokens=tile_tokens, path=path)
    if compile:  # as the default does on a GPU, with a backend that runs the traced graphs as they are
        assert compiled.apply(layers, compiled.compile_options({"backend": "aot_eager", "fullgraph": True}))
        before = compilations()
    # forward and backward partitions differ; with the split, stages end inside blocks
    plan = StagePlan.parse("3,3|2,3,3" if split else "2,1|2,1,2")
    # one micro-batch: the load-balancing loss is the whole batch's (per micro-batch it would be another)
    moe = bool(getattr(model.config, "output_router_logits", False))
    engine = PipelineEngine(layers, [WorkerDevice("cpu", i) for i in range(2)], plan=plan,
                            microbatches_per_round=2 if moe else 3, num_rounds=1)  # fmt: skip
    if moe:
        engine.planner.microbatches_per_round = 1  # (two workers, one micro-batch: the batch's own aux loss)
    try:
        mask, positions = hf.plain_inputs(batch["attention_mask"], None)
        inputs = (batch["input_ids"], mask, positions, batch["labels"])
        loss = engine.train_batch(inputs, batch["labels"], lambda out, _: out, reduction=hf.counted_tokens)
        engine.store.install_grads()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        assert not compile or compilations() > before  # the blocks did run compiled
    finally:
        engine.close()
        compiled.remove(layers)
    want = reference(**batch)
    want.loss.backward()
    assert relative_error(loss, want.loss.detach()) <= tolerance
    expected = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        assert relative_error(grad, expected[name]) <= tolerance, name


@pytest.mark.parametrize("split", [False, True, "tiled"])
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_every_architecture_equals_the_model_run_directly(arch, split):
    """Whole blocks, blocks split into their attention and MLP halves, and those halves' token-wise work in
    tiles of 7 of a micro-batch's 20 tokens (not with a load-balancing loss, which needs the router whole)."""
    model = tiny(arch)
    if split == "tiled" and getattr(model.config, "output_router_logits", False):
        pytest.skip("tile_tokens refuses a mixture of experts whose router logits are collected")
    assert_equals_the_model_run_directly(model, bool(split), tile_tokens=7 if split == "tiled" else None)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_every_architecture_with_lora_adapters_equals_the_model_run_directly(arch):
    """Adapters on the blocks' linear layers (on a mixture of experts, the attention's: peft's "all-linear"
    wraps experts and routers as parameters, which is refused, below)."""
    peft = pytest.importorskip("peft")
    model = tiny(arch)
    moe = getattr(model.config, "output_router_logits", False)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj"] if moe else "all-linear"
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets, lora_dropout=0.0))
    assert_equals_the_model_run_directly(model, split=False)


DENSE = sorted(arch for arch, (_, _, extra) in CONFIGS.items() if "output_router_logits" not in extra)


@pytest.mark.timeout(120)
@pytest.mark.alongside  # dynamo tracing on one core: half of these in a second process (tests/alongside.py)
@pytest.mark.parametrize("arch", DENSE)
def test_every_dense_architectures_compiled_blocks_equal_the_model_run_directly(arch):
    """What ``compile="auto"`` does to each family on a GPU, traced here by dynamo (``aot_eager``: the graphs
    run as traced): every block compiles and the numbers stay the model's, the padded mask, sliding windows,
    soft-capping and scalings included. (MoE blocks stay eager.)"""
    assert_equals_the_model_run_directly(tiny(arch), split=False, compile=True)


@pytest.mark.timeout(120)
@pytest.mark.alongside
def test_compiled_blocks_with_lora_adapters_equal_the_model_run_directly():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny("qwen3"), peft.LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0))
    assert_equals_the_model_run_directly(model, split=False, compile=True)


def test_lora_on_parameters_is_refused_with_what_to_target():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny("qwen3_moe"), peft.LoraConfig(r=4, target_modules="all-linear"))
    if not any(type(m).__name__ == "ParamWrapper" for m in model.modules()):
        pytest.skip(f"peft {peft.__version__} wraps no parameters here")
    with pytest.raises(ValueError, match=r"LoRA adapters on parameters .*target_modules=\['q_proj'"):
        hf.build_layers(model)


def test_the_table_holds_every_architecture_the_tests_run():
    assert {CONFIGS[a][1] for a in CONFIGS} == set(hf.FAMILIES)


def test_a_model_unlike_its_entry_and_a_switch_the_stages_do_not_make_take_the_generic_path():
    """The table refuses what its entry does not describe; under ``hf_stages="auto"`` the generic path trains it
    with the model's own code (Gemma 3's bidirectional attention masks included)."""
    model = tiny("llama")
    family = hf.Family(halves=hf.families.SANDWICH)
    with pytest.raises(ValueError, match=r"expects decoder blocks with the norms .*but block 0 has"):
        hf.decoder_layers(model, family=family)
    gemma = tiny("gemma3")
    gemma.config.use_bidirectional_attention = True
    with pytest.raises(ValueError, match=r"use_bidirectional_attention.*not causal"):
        hf.build_layers(gemma, path="table")
    _, how = hf.pipeline_layers(copy.deepcopy(gemma))
    assert "takes the generic path (the table's entry does not apply: " in how and "use_bidirectional" in how
    assert_equals_the_model_run_directly(gemma, split=False)


def test_a_subclass_running_its_parents_forward_takes_the_parents_entry_and_one_overriding_it_the_generic_path():
    """A subclass that overrides ``forward`` may compute anything: the table's entry is not its description,
    the generic path runs its own code."""

    class Renamed(transformers.LlamaForCausalLM):
        def describe(self) -> str:
            return "a method added, the arithmetic unchanged"

    class Rewired(transformers.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    assert_equals_the_model_run_directly(Renamed(tiny("llama").config), split=True)
    rewired = Rewired(tiny("llama").config)
    assert "Rewired takes the generic path" in hf.pipeline_layers(copy.deepcopy(rewired))[1]
    assert_equals_the_model_run_directly(rewired, split=False)
