"""QLoRA: a model loaded with 4-bit base weights (bitsandbytes, as transformers' ``BitsAndBytesConfig`` makes it)
and wrapped by peft's LoRA trains under roundpipe to plain Lightning's adapter weights; the packed weights stay
packed on the host."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from helpers import relative_error
from test_tokens import instruction_batch
from torch.utils.data import DataLoader

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")

from lightning_roundpipe import RoundPipeStrategy  # noqa: E402
from lightning_roundpipe.models import quantized  # noqa: E402

VOCAB = 101


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """A small Llama saved once, for every test to load quantized (as users load theirs)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, attn_implementation="sdpa",
    )  # fmt: skip
    path = tmp_path_factory.mktemp("qlora") / "tiny-llama"
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def load(
    path: str, quant_type: str = "nf4", double: bool = True, compute: torch.dtype = torch.float32
) -> torch.nn.Module:
    config = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=double,
        bnb_4bit_compute_dtype=compute,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=config, device_map="cpu")
    torch.manual_seed(1)  # the adapters' initialisation (B starts at zero: A's draws are the same in every run)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    # from_pretrained leaves the model in eval mode, and Lightning keeps submodules' modes: on a CPU with
    # AVX512-BF16, bitsandbytes then repacks an eval-mode 4-bit layer fed a tensor without grad (the first
    # block's projections) for its CPU inference kernel, which rounds otherwise than matmul_4bit, in plain's
    # training only. In train mode both sides run matmul_4bit, as every layer does on a GPU.
    return peft.get_peft_model(model, lora).train()


class QLoRA(L.LightningModule):
    def __init__(self, path: str, sgd: bool = False, **quant) -> None:
        super().__init__()
        self.model = load(path, **quant)
        self.sgd = sgd

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        if self.sgd:
            return torch.optim.SGD(self.parameters(), lr=0.1)
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def data(steps: int = 3) -> DataLoader:
    return DataLoader([instruction_batch(6, seed=s, longest=20) for s in range(steps)], batch_size=None)


def fit(module: L.LightningModule, strategy, devices: int, steps: int = 3) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, data(steps))
    return trainer


def adapters(module: L.LightningModule) -> torch.Tensor:
    return torch.cat([p.detach().flatten().float() for p in module.parameters() if p.requires_grad])


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("quant_type", "double", "compute", "sgd", "tolerance"),
    # bf16 compute: the 4-bit product rounds by matrix shape (micro-batches against the whole batch). Adam's
    # first step from B=0 turns such rounding into +-lr where a gradient is near zero (2.6e-3 relative on an
    # AMD CPU with AVX512-BF16 even with one micro-batch, whose SGD step is plain's to 4e-9), so bf16 is
    # checked with SGD: 3.5e-5 there, 0.2% of how far the adapters moved (the bound: 2%). In fp32, plain's.
    [("nf4", True, torch.float32, False, 1e-4), ("fp4", False, torch.float32, False, 1e-4),
     ("nf4", True, torch.bfloat16, True, 4e-4)],
)  # fmt: skip
def test_qlora_trains_to_the_adapter_weights_of_plain_lightning(saved, quant_type, double, compute, sgd, tolerance):
    """Three steps of padded batches, two workers, three micro-batches, synchronous: the adapters equal plain
    Lightning's on the same quantized model; the packed weights were never dequantized on the host."""
    plain = QLoRA(saved, sgd, quant_type=quant_type, double=double, compute=compute)
    start = adapters(plain)
    fit(plain, "auto", 1)
    ours = QLoRA(saved, sgd, quant_type=quant_type, double=double, compute=compute)
    packed = {n: p.detach().clone() for n, p in ours.named_parameters() if p.dtype == torch.uint8}
    assert packed and adapters(ours).equal(start)
    fit(ours, RoundPipeStrategy(num_microbatches=3, async_optimizer=False), 2)
    assert relative_error(adapters(ours), adapters(plain)) <= tolerance
    assert relative_error(adapters(ours), start) > 1e-3  # it trained
    for name, p in ours.named_parameters():  # the base weights: packed, unchanged, still the model's own
        if name in packed:
            assert p.dtype == torch.uint8 and p.equal(packed[name])
    assert not any(hasattr(m, "_roundpipe_4bit") for m in ours.modules())  # taken off at teardown
    x = torch.randint(0, VOCAB, (2, 7))
    assert torch.allclose(ours.model(input_ids=x).logits, plain.model(input_ids=x).logits, atol=1e-2)  # usable


@pytest.mark.timeout(120)
def test_qlora_with_split_and_tiled_blocks_equals_plain_lightning(saved):
    """Each block as two layers, its token-wise parts over tiles of 8 tokens (recomputed tile by tile in
    backward): the 4-bit layers' state is the slot's in every tile."""
    plain = QLoRA(saved)
    fit(plain, "auto", 1, steps=2)
    ours = QLoRA(saved)
    strategy = RoundPipeStrategy(num_microbatches=3, async_optimizer=False, split_decoder_layers=True, tile_tokens=8)
    fit(ours, strategy, 2, steps=2)
    assert relative_error(adapters(ours), adapters(plain)) <= 1e-4


@pytest.mark.timeout(120)
def test_the_host_holds_the_packed_weights_once_and_only_adapters_get_optimizer_state(saved):
    """The frozen 4-bit weights are uint8 groups of the host store, within 10% of the packed size with their
    quantization state; no floating-point copy of them exists; masters and gradients only for the adapters."""
    from lightning_roundpipe.discovery import pipelined_layers
    from lightning_roundpipe.options import RoundPipeOptions
    from lightning_roundpipe.runtime.host_store import HostStore

    module = QLoRA(saved)
    pipelined = pipelined_layers(module, RoundPipeOptions(), cuda=False)
    try:
        assert pipelined.four_bit == 3 * 7  # q, k, v, o, gate, up, down in each of three blocks
        store = HostStore(pipelined.layers, compute_dtype=torch.bfloat16)
        packed = quantized.packed_bytes(module.model)
        weights = sum(m.weight.numel() for m in quantized.four_bit_layers(module.model))
        frozen_uint8 = sum(g.data.numel() for g in store.groups if g.kind == "frozen" and g.data.dtype == torch.uint8)
        assert frozen_uint8 == weights  # packed as loaded: two codes per byte
        states = sum(g.data.nbytes for g in store.groups if g.kind == "buffer")
        assert weights <= frozen_uint8 + states <= 1.1 * packed
        trainable = sum(g.data.numel() for g in store.groups if g.trainable)
        assert trainable == sum(p.numel() for p in module.parameters() if p.requires_grad)
        floats = sum(g.data.numel() for g in store.groups if g.kind == "frozen" and g.data.dtype.is_floating_point)
        assert floats < weights  # embeddings, norms and head: nothing the size of the unpacked weights (4x)
    finally:
        pipelined.undo()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("place", ["host", "device"])  # "device": what the default "auto" picks on one GPU
def test_asynchronous_qlora_equals_the_staleness_one_reference(saved, place):
    ours = QLoRA(saved)
    fit(ours, RoundPipeStrategy(num_microbatches=3, optimizer_on=place), 2 if place == "host" else 1)  # (one device)
    L.seed_everything(0, verbose=False)
    reference = QLoRA(saved)
    current, lagged = reference.model, copy.deepcopy(reference.model)
    trainable = [p for p in current.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    for batch in data():
        lagged.zero_grad()
        lagged(**batch).loss.backward()
        for p, q in zip(trainable, [q for q in lagged.parameters() if q.requires_grad]):
            p.grad = q.grad.clone()
        before = [p.detach().clone() for p in trainable]
        opt.step()
        for q, b in zip([q for q in lagged.parameters() if q.requires_grad], before):
            q.data.copy_(b)
    assert relative_error(adapters(ours), adapters(reference)) <= 1e-4


@pytest.mark.timeout(120)
def test_a_qlora_checkpoint_resumes_exactly(saved, tmp_path):
    """Asynchronous, an update pending at the save: an epoch of two steps, saved (without the base weights),
    then another after resuming equals two epochs straight."""

    def run(epochs: int, where: str, ckpt: str | None = None) -> L.LightningModule:
        L.seed_everything(0, verbose=False)
        module = QLoRA(saved)
        keep = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / where, filename="{epoch}", save_top_k=-1)
        trainer = L.Trainer(
            strategy=RoundPipeStrategy(num_microbatches=3), accelerator="cpu", devices=2, max_epochs=epochs,
            logger=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[keep],
        )  # fmt: skip
        trainer.fit(module, data(2), ckpt_path=ckpt)
        return module

    straight = run(2, "straight")
    run(1, "first")
    checkpoint = tmp_path / "first" / "epoch=0.ckpt"
    saved_keys = torch.load(checkpoint, weights_only=False)["state_dict"]
    assert not any(".base_layer.weight" in k for k in saved_keys) and any("lora_A" in k for k in saved_keys)
    resumed = run(2, "resumed", ckpt=str(checkpoint))
    assert relative_error(adapters(resumed), adapters(straight)) <= 1e-6
    base = {n: p for n, p in straight.named_parameters() if p.dtype == torch.uint8}
    assert base and all(p.equal(base[n]) for n, p in resumed.named_parameters() if n in base)


def test_an_8bit_base_is_refused_with_what_to_do(saved):
    config = transformers.BitsAndBytesConfig(load_in_8bit=True)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(saved, quantization_config=config, device_map="cpu")
    except Exception as error:
        pytest.skip(f"8-bit loading on this CPU: {error}")
    with pytest.raises(ValueError, match="load_in_4bit=True"):
        quantized.refuse_8bit(model)


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_qlora_on_a_gpu_with_every_default_trains_like_plain_lightning(saved):
    """bitsandbytes' CUDA kernels on the worker, the packed weights and their state uploaded from the host; plain
    Lightning runs the same model on the card. bf16-mixed, bf16 compute: within bf16's rounding. SGD, not Adam:
    Adam's first step from the adapters' zero B is ``lr * sign(grad)``, so every tiny gradient whose sign bf16's
    rounding flips (our kernels against transformers' eager ones) moves by ``2 * lr``: 12% of the movement on an
    H200 (2026-12-03) with nothing wrong. SGD's steps follow the gradients' values (1% on the CPU)."""

    class SGDQLoRA(QLoRA):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1.0)

    def run(strategy) -> QLoRA:
        module = SGDQLoRA(saved, compute=torch.bfloat16)
        L.seed_everything(0, verbose=False)
        L.Trainer(
            strategy=strategy, accelerator="gpu", devices=1, precision="bf16-mixed", max_epochs=1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        ).fit(module, data(3))  # fmt: skip
        return module

    plain = run("auto")
    ours = run(RoundPipeStrategy(async_optimizer=False))
    start = adapters(QLoRA(saved, compute=torch.bfloat16))
    moved = relative_error(adapters(plain).cpu(), start)
    assert moved > 1e-3 and relative_error(adapters(ours), adapters(plain).cpu()) <= 0.05 * moved
    assert all(p.device.type == "cpu" for p in ours.parameters())  # the model stays on the host
