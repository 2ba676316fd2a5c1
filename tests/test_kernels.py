"""liger-kernel's kernels bound onto one Hugging Face model (``RoundPipeStrategy(kernels=...)``): only that
instance changes, the workers' replicas keep the binding, CPU tensors keep the model's own code, and the
choice is checked. The kernels themselves need CUDA (``test_gpu.py``); here a stand-in package records
what would have run them."""

from __future__ import annotations

import copy
import sys
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_roundpipe import RoundPipeStrategy  # noqa: E402
from lightning_roundpipe.models import hf  # noqa: E402
from lightning_roundpipe.runtime.replicas import weightless_replica  # noqa: E402


@pytest.fixture
def fake_liger(monkeypatch):
    """A ``liger_kernel`` whose functions count their calls (they would run Triton on CUDA tensors)."""
    calls: dict[str, int] = {}

    def counted(name):
        def kernel(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            raise AssertionError(f"{name} ran on {args[0].device}: the kernels are for CUDA tensors")

        return kernel

    root = types.ModuleType("liger_kernel")
    transformers_ = types.ModuleType("liger_kernel.transformers")
    functional = types.ModuleType("liger_kernel.transformers.functional")
    rope = types.ModuleType("liger_kernel.transformers.rope")
    functional.liger_rms_norm = counted("rms_norm")
    functional.liger_swiglu = counted("swiglu")
    rope.liger_rotary_pos_emb = counted("rope")
    transformers_.LigerFusedLinearCrossEntropyLoss = counted("flce")
    for module in (root, transformers_, functional, rope):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    return calls


def tiny(kind: str = "qwen3") -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))


def batch(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_the_kernels_bind_to_this_model_only_and_come_off_again(fake_liger, kind):
    model, other = tiny(kind), tiny(kind)
    modeling = sys.modules[type(model).__module__]
    rope_before, forward_before = modeling.apply_rotary_pos_emb, type(model.model.norm).forward
    layers = hf.build_layers(model)
    applied = hf.kernels.apply_liger(model, layers)
    norms = 1 + 2 * 2 + (2 * 2 if kind == "qwen3" else 0)  # final, two per block, Qwen3's q/k norms
    assert applied == [f"RMSNorm x{norms}", "SwiGLU x2", "fused linear cross-entropy x1", "rotary embedding x2"]
    assert layers[-1].fused_loss is True
    assert all("forward" not in m.__dict__ for m in other.modules())  # the other model of the class
    assert modeling.apply_rotary_pos_emb is rope_before and type(model.model.norm).forward is forward_before
    hf.kernels.remove(model)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_on_cpu_tensors_the_bound_modules_run_the_models_own_code(fake_liger):
    model = tiny()
    reference = copy.deepcopy(model)
    hf.kernels.apply_liger(model, hf.build_layers(model))
    data = batch(model)
    got, want = model(**data).loss, reference(**data).loss
    assert torch.equal(got, want) and not fake_liger


def test_the_workers_replicas_keep_the_binding_on_their_own_modules(fake_liger):
    model = tiny()
    layers = hf.build_layers(model)
    hf.kernels.apply_liger(model, layers)
    block = weightless_replica(layers[1])  # a decoder stage
    mlp, attention = block.layer.mlp, block.layer.self_attn
    assert mlp.forward.__self__ is mlp and attention.forward.__self__ is attention
    assert mlp is not layers[1].layer.mlp


def test_a_module_the_user_patched_is_left_as_it_is(fake_liger):
    model = tiny()
    own = types.MethodType(lambda self, x: x, model.model.norm)
    model.model.norm.forward = own
    applied = hf.kernels.apply_liger(model, hf.build_layers(model))
    assert model.model.norm.forward is own and "RMSNorm x8" in applied  # the other eight


def test_the_choice_is_checked_and_auto_keeps_cpu_workers_on_the_models_code(monkeypatch):
    assert hf.kernels.resolve("none", cuda=True) is False
    assert hf.kernels.resolve("auto", cuda=False) is False
    with pytest.raises(ValueError, match="CUDA workers; these workers are CPU threads"):
        hf.kernels.resolve("liger", cuda=False)
    monkeypatch.setattr(hf.kernels, "liger_installed", lambda: False)
    assert hf.kernels.resolve("auto", cuda=True) is False
    with pytest.raises(ImportError, match="pip install liger-kernel"):
        hf.kernels.resolve("liger", cuda=True)
    with pytest.raises(ValueError, match=r"kernels='fast'\) must be one of \('auto', 'liger', 'none'\)"):
        RoundPipeStrategy(kernels="fast")


@pytest.mark.parametrize("tokens", [8192, 32768, 65536])
def test_liger_cross_entropy_chunks_are_about_2048_tokens(tokens):
    """Liger cuts ``tokens`` into ``ceil(vocab / (const * hidden))`` chunks rounded up to a power of two;
    the constant we pass makes them 2,048 tokens at the Qwen3 shapes (Liger's own: 128 at 8,192)."""
    for hidden in (2048, 2560, 4096):
        const = hf.kernels.chunk_mem_const(tokens, hidden, 151936)
        pieces = -(-151936 // (const * hidden))
        chunk = 1 << (-(-tokens // pieces) - 1).bit_length()
        assert chunk == 2048, (hidden, const, chunk)
    assert hf.kernels.chunk_mem_const(16, 64, 97) >= 1
