"""Packed micro-batches (issue 39, ``RoundPipeStrategy(split_by="packed")``): each micro-batch's sequences end to
end in one row without padding, positions restarting, each sequence's first label -100, attention within each
sequence; training equals plain Lightning's on padded batches of new lengths (with LoRA, with a batch of one
length, split blocks), asynchronously the staleness-one reference; models that cannot be packed are refused."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import relative_error
from test_hf import tiny
from test_tokens import LM, as_inputs, batches, fit, flat, instruction_batch, staleness_one_reference
from torch.utils.data import DataLoader

transformers = pytest.importorskip("transformers")

from lightning_roundpipe import RoundPipeStrategy  # noqa: E402
from lightning_roundpipe.models import hf  # noqa: E402
from lightning_roundpipe.models.hf import packed  # noqa: E402
from lightning_roundpipe.models.hf.tokens import TokenSplit  # noqa: E402


def labelled_throughout(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every real token labelled (no prompt): a sequence's first label is a token, which packing must drop."""
    return dict(batch, labels=batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100))


@pytest.mark.parametrize("prompts", [True, False])
def test_packed_micro_batches_hold_only_real_tokens_with_the_same_loss_terms(prompts):
    batch = instruction_batch(rows=12, seed=0)
    batch = batch if prompts else labelled_throughout(batch)
    inputs = as_inputs(batch)
    split = TokenSplit(span=16.0, packed=True)
    micro, targets = split(inputs, inputs[-1], 4)
    lengths = batch["attention_mask"].sum(1).tolist()
    assert len(micro) == 4 and all(t is m[3] for m, t in zip(micro, targets))
    assert sum(m[0].numel() for m in micro) == sum(lengths)  # no padding at all
    assert_packed_from(batch, micro, split, inputs)
    costs = [sum(split.cost(1, b - a) for a, b in zip(m[1][:-1].tolist(), m[1][1:].tolist())) for m in micro]
    assert max(costs) <= 2 * sum(split.cost(1, n) for n in lengths) / 4  # balanced within twice the mean


def test_packed_groups_number_what_was_asked_whatever_sum_s_rounding(monkeypatch):
    """Python 3.12's ``sum`` compensates rounding: a run's cost came out a hair below the running total the
    cut compares with it, and one micro-batch asked of the H200 run's eighth batch came back as two. ``sum``
    made compensated here (as on 3.12) on lengths where that differs from adding up in order."""
    import math

    from lightning_roundpipe.models.hf import tokens

    monkeypatch.setattr(tokens, "sum", lambda items, start=0: math.fsum(items) + start, raising=False)
    split, lengths = TokenSplit(span=24576.0, packed=True), [644, 2788, 3530, 1282, 3982, 2437, 3144, 3574]
    in_order, costs = 0.0, sorted((split.cost(1, n) for n in lengths), reverse=True)
    for cost in costs:
        in_order += cost
    assert math.fsum(costs) != in_order  # the case that failed
    for num in range(1, len(lengths) + 1):
        groups = split.groups(lengths, num, packed=True)
        assert len(groups) == num and sorted(r for g in groups for r in g) == list(range(len(lengths)))


def assert_packed_from(padded, micro, split, inputs) -> None:
    """Each packed micro-batch one row of whole sequences of ``padded`` (each row once), positions restarting,
    each sequence's first label -100 and the rest its own; the same counted tokens; ``sizes`` as the cut."""
    rows, seen = padded["input_ids"].shape[0], []
    for ids, bounds, positions, labels in micro:
        assert ids.shape[0] == 1 and bounds.dtype == torch.int32 and packed.is_packed(bounds)
        assert int(bounds[-1]) == ids.shape[1] and positions.shape == ids.shape
        for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            assert positions[0, a:b].tolist() == list(range(b - a))  # positions restart at each sequence
            row = next(r for r in range(rows) if r not in seen and padded["input_ids"][r, : b - a].equal(ids[0, a:b]))
            seen.append(row)
            # nothing predicts a sequence's first token
            assert labels[0, a:b].tolist() == [-100, *padded["labels"][row, 1 : b - a].tolist()]
    assert sorted(seen) == list(range(rows))
    counted = sum(int(hf.counted_tokens(m[3])) for m in micro)
    assert counted == int(hf.counted_tokens(inputs[-1]))  # the loss is normalised over the same count
    at = split.sizes(inputs, inputs[-1])
    for num in (1, 3, 4, rows):
        assert at(num) == [m[0].numel() for m in split(inputs, inputs[-1], num)[0]]


def test_a_batch_that_cannot_be_packed_is_cut_by_tokens_as_before():
    left = {k: v.flip(1) for k, v in instruction_batch(rows=4, seed=2).items()}  # left padding
    left["labels"] = left["input_ids"].masked_fill(left["attention_mask"] == 0, -100)
    inputs = as_inputs(left)
    micro, _ = TokenSplit(packed=True)(inputs, inputs[-1], 2)
    assert not any(packed.is_packed(m[1]) for m in micro)  # padded rows, the mask kept


@pytest.mark.parametrize("gqa", [True, False])
def test_attention_sequence_by_sequence_equals_sdpa_on_each_sequence_alone(gqa):
    g = torch.Generator().manual_seed(0)
    lengths = [5, 1, 9, 3]
    total, heads, kv, dim = sum(lengths), 4, 2 if gqa else 4, 8
    q, k, v = (torch.randn(1, h, total, dim, generator=g) for h in (heads, kv, kv))
    bounds = torch.tensor([0, 5, 6, 15, 18], dtype=torch.int32)
    module = torch.nn.Module()
    out, _ = packed.attention(module, q, k, v, None, scaling=0.3, cu_seq_lens_q=bounds, max_length_q=total)
    assert out.shape == (1, total, heads, dim)
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        kk, vv = (t[:, :, a:b].repeat_interleave(heads // kv, dim=1) for t in (k, v))
        alone = F.scaled_dot_product_attention(q[:, :, a:b], kk, vv, is_causal=True, scale=0.3)
        assert torch.allclose(out[0, a:b], alone[0].transpose(0, 1), atol=1e-6)


@pytest.mark.parametrize(
    ("takes", "expected"),
    [  # torch 2.10, 2.11, 2.13's keywords
        ({"is_causal", "return_aux"}, {"is_causal": True}),
        ({"return_aux", "scale", "window_size"}, {"scale": 0.125, "window_size": (-1, 0)}),
        ({"scale", "window_size", "enable_gqa"}, {"scale": 0.125, "window_size": (-1, 0), "enable_gqa": True}),
    ],
)
def test_the_flash_call_speaks_each_torch_release_s_varlen_keywords(takes, expected):
    """``_flash`` against stand-ins for ``varlen_attn`` with each release's keywords: causal, the scale where it is
    taken (a model's own scale refused where it is not), GQA by the flag where there is one; the layout back."""
    calls = []

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, **options):
        calls.append(options)
        out = packed._by_sequence(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), cu_q, 0.125)
        return out

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(h, 11, 64, generator=g) for h in (4, 2, 2))
    bounds = torch.tensor([0, 4, 11], dtype=torch.int32)
    old = packed._VARLEN_TAKES
    try:
        packed._VARLEN_TAKES = frozenset(takes)
        out = packed._flash(varlen, q, k, v, bounds, 11, 0.125)  # 0.125 = 1 / sqrt(64)
        assert calls == [expected] and out.shape == (11, 4, 64)
        assert torch.allclose(out, packed._by_sequence(q, k, v, bounds, 0.125))
        if "scale" not in takes:
            with pytest.raises(ValueError, match="takes no scale"):
                packed._flash(varlen, q, k, v, bounds, 11, 0.3)
    finally:
        packed._VARLEN_TAKES = old


@pytest.mark.parametrize(
    ("lora", "lengths", "split", "prompts"),
    [
        (False, {}, False, True), (True, {}, False, True), (False, {"shortest": 12, "longest": 12}, False, True),
        (False, {}, True, True), (False, {}, False, False),
    ],
)  # fmt: skip
def test_training_packed_equals_plain_lightning(monkeypatch, lora, lengths, split, prompts):
    """Four steps of eight sequences of new lengths, two workers, four micro-batches, synchronous: the weights
    equal plain Lightning's; the micro-batches were packed (one row each, no padding) unless a batch has none."""
    seen = []
    call = TokenSplit.__call__
    monkeypatch.setattr(TokenSplit, "__call__", lambda *a: seen.append(result := call(*a)) or result)

    def data(**kwargs):
        loader = batches(**kwargs)
        return loader if prompts else DataLoader([labelled_throughout(b) for b in loader], batch_size=None)

    plain, _ = fit("auto", 1, data(**lengths), lora)
    strategy = RoundPipeStrategy(
        num_microbatches=4, async_optimizer=False, split_by="packed", split_decoder_layers=split
    )
    ours, trainer = fit(strategy, 2, data(**lengths), lora, data(steps=1, **lengths))
    assert relative_error(flat(ours), flat(plain)) <= 1e-5
    assert relative_error(flat(ours), flat(LM(lora))) > 1e-4  # it trained
    assert torch.isfinite(trainer.callback_metrics["val_loss"])
    rows = [m for micro, _ in seen for m in micro]
    if lengths:  # one length: no padding, nothing to pack (cut by samples)
        assert not any(packed.is_packed(m[1]) for m in rows)
    else:
        assert rows and all(m[0].shape[0] == 1 and packed.is_packed(m[1]) for m in rows)
    assert ours.model.config._attn_implementation == "sdpa"  # the user's model keeps its own


@pytest.mark.timeout(120)
def test_asynchronous_packed_training_equals_the_staleness_one_reference():
    ours, _ = fit(RoundPipeStrategy(num_microbatches=4, split_by="packed"), 2, batches())
    assert relative_error(flat(ours), flat(staleness_one_reference(batches()))) <= 1e-5


def test_the_default_packs_padded_batches_only_where_the_flash_kernel_runs(monkeypatch):
    """``split_by="auto"`` packs a padded batch's micro-batches on a CUDA worker where torch's varlen flash kernel
    runs (half precision asked of it); not where it cannot (a reason), not without a CUDA worker, not for a
    model that cannot be packed, and ``split_by="tokens"`` keeps padded rows."""
    from lightning_roundpipe.discovery import pipelined_layers
    from lightning_roundpipe.options import RoundPipeOptions

    asked = []

    def why_not(module, device, half=None):
        asked.append(half)
        return "older than sm80" if device.index == 1 else None if half else "attention would run in float32"

    monkeypatch.setattr(packed, "why_not_flash", why_not)
    cuda, options = torch.device("cuda", 0), RoundPipeOptions(compile=False, kernels="none")

    def packs(module=None, options=options, devices=(cuda,), half=True) -> bool:
        return pipelined_layers(module or LM(), options, bool(devices), devices, half).split.packed

    assert packs() and asked == [True]
    split = pipelined_layers(LM(), options, True, [cuda, cuda], True).split
    assert not split.pack_unpadded  # a batch of one length keeps its rows under the default (nothing to remove)
    for lengths, packed_rows in (({}, True), ({"shortest": 12, "longest": 12}, False)):
        inputs = as_inputs(instruction_batch(rows=6, seed=1, **lengths))
        micro, _ = split(inputs, inputs[-1], 2)
        assert all(packed.is_packed(m[1]) == packed_rows for m in micro)
    asked.clear()
    assert not packs(half=None)  # no half compute dtype: the (float32) weights decide
    assert not packs(devices=())
    assert not packs(devices=(cuda, torch.device("cuda", 1)))  # every worker must run it
    assert not packs(options=RoundPipeOptions(compile=False, kernels="none", split_by="tokens"))
    eager = LM()
    eager.model = tiny("qwen3", attn="eager")
    assert not packs(eager)
    assert asked == [None, True, True]


def test_models_that_cannot_be_packed_are_refused_at_setup():
    from test_hf import tiny_moe

    from lightning_roundpipe.discovery import pipelined_layers
    from lightning_roundpipe.options import RoundPipeOptions

    options = RoundPipeOptions(split_by="packed")
    assert pipelined_layers(LM(), options, cuda=False).split.packed
    eager = LM()
    eager.model = tiny("qwen3", attn="eager")
    with pytest.raises(ValueError, match="attn_implementation='eager'"):
        pipelined_layers(eager, options, cuda=False)
    moe = LM()
    moe.model = tiny_moe(aux=False)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        pipelined_layers(moe, options, cuda=False)
    with pytest.raises(ValueError, match="other than the architecture table's"):
        pipelined_layers(LM(), RoundPipeOptions(split_by="packed", hf_stages="generic"), cuda=False)
    windowed = LM()
    windowed.model = tiny("qwen3")
    windowed.model.config.use_sliding_window, windowed.model.config.sliding_window = True, 4
    windowed.model.config.layer_types = ["sliding_attention"] * 3
    with pytest.raises(ValueError, match="sliding-window"):
        pipelined_layers(windowed, options, cuda=False)
    dropout = LM()
    dropout.model.config.attention_dropout = 0.1
    with pytest.raises(ValueError, match="attention dropout"):
        pipelined_layers(dropout, options, cuda=False)
    capped = LM()
    capped.model.config.attn_logit_softcapping = 50.0  # as Gemma2's config carries it
    with pytest.raises(ValueError, match="soft-capped"):
        pipelined_layers(capped, options, cuda=False)
    from helpers import BoringPipeline, boring_data

    with pytest.raises(ValueError, match=r"split_by='packed'\) cuts a Hugging Face model's padded token batches"):
        L.Trainer(strategy=RoundPipeStrategy(split_by="packed"), accelerator="cpu", devices=2, max_steps=1,
                  logger=False, enable_progress_bar=False).fit(BoringPipeline(), boring_data())  # fmt: skip


@pytest.mark.gpu
def test_packed_attention_on_a_gpu_runs_torch_s_varlen_kernel_like_sdpa_per_sequence():
    """The flash path (``torch.nn.attention.varlen``) against SDPA on each sequence alone, bf16, GQA: outputs and
    gradients within bf16 rounding."""
    if packed._VARLEN is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = [700, 1, 1300, 257]
    total, bounds = sum(lengths), torch.tensor([0, 700, 701, 2001, 2258], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(1, h, total, 128, generator=g, device="cuda", dtype=torch.bfloat16) for h in (16, 8, 8))
    for t in (q, k, v):
        t.requires_grad_(True)
    scale = 128**-0.5  # torch 2.10's varlen_attn takes no other
    out, _ = packed.attention(torch.nn.Module(), q, k, v, None, scaling=scale, cu_seq_lens_q=bounds, max_length_q=total)
    reference = packed._by_sequence(q[0], k[0], v[0], bounds, scale)[None]
    assert relative_error(out.float(), reference.float()) <= 2e-2
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    expected = torch.autograd.grad(reference.float().square().sum(), (q, k, v))
    for got, want in zip(grads, expected):
        assert relative_error(got.float(), want.float()) <= 3e-2


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("split_by", ["packed", "auto"])
def test_packed_training_on_a_gpu_with_compiled_blocks_trains_like_plain_lightning(monkeypatch, recwarn, split_by):
    """Under ``Trainer`` on the GPU, bf16-mixed, every default (``split_by="auto"`` packs padded batches where
    torch's flash kernel runs) and ``split_by="packed"`` (blocks compiled by Inductor around the varlen kernel):
    weights moved within bf16 rounding of plain Lightning's on padded batches, the micro-batches packed and run
    by the flash kernel, and no block fell back to eager."""
    from lightning_roundpipe.runtime.compiles import compilations

    data = batches(steps=3, longest=40)
    plain = train_on_a_gpu("auto", data)
    before = compilations()
    flash = spy_on_flash(monkeypatch)
    ours = train_on_a_gpu(RoundPipeStrategy(async_optimizer=False, num_microbatches=3, split_by=split_by), data)
    assert flash and all(flash)
    assert 0 < compilations() - before <= 4  # not one per length (3 steps, 9 micro-batches, all of new lengths)
    assert not [str(w.message) for w in recwarn if "could not compile" in str(w.message)]
    start = flat(GpuLM())
    assert relative_error(flat(ours) - start, flat(plain) - start) <= 0.1


def spy_on_flash(monkeypatch) -> list[bool]:
    """Per packed micro-batch and stage, whether torch's flash kernel runs its attention: decided eagerly,
    outside the compiled blocks (a spy inside them made dynamo guard on its count and recompile per call)."""
    from lightning_roundpipe.models.hf import stages

    flash: list[bool] = []
    decide = stages.attention_kwargs

    def spied(*args):
        kwargs = decide(*args)
        if kwargs:
            flash.append(kwargs["roundpipe_flash"])
        return kwargs

    monkeypatch.setattr(stages, "attention_kwargs", spied)
    return flash


class GpuLM(LM):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def train_on_a_gpu(strategy, data) -> GpuLM:
    """Three steps under ``Trainer`` on one GPU, bf16-mixed; the module back on the host."""
    L.seed_everything(0, verbose=False)
    module = GpuLM()
    L.Trainer(
        strategy=strategy, accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    ).fit(module, data)  # fmt: skip
    return module.cpu()


def test_where_the_flash_kernel_cannot_run_packed_asks_fail_and_flattened_batches_fall_back(monkeypatch):
    """``split_by="packed"`` asked for the flash kernel: its first micro-batch says why it cannot run; under the
    default a flattened batch's micro-batches run SDPA sequence by sequence instead, with one warning."""
    monkeypatch.setattr(packed, "why_not_flash", lambda module, device: "a reason")
    module = torch.nn.Module()
    assert packed._choose_flash(module, torch.device("cpu")) is False
    packed.require_flash([module])
    with pytest.raises(ValueError, match=r"split_by='packed'.*cannot run here: a reason"):
        packed._choose_flash(module, torch.device("cpu"))
    monkeypatch.setattr(packed, "why_not_flash", lambda module, device: None)
    assert packed._choose_flash(module, torch.device("cpu")) is True


def test_the_masked_fallback_calls_sdpa_as_its_fused_cuda_kernels_take_it(monkeypatch):
    """Where the flash kernel cannot run on CUDA, a packed micro-batch takes SDPA with a mask: four-dimensional
    inputs, keys repeated for grouped queries, no ``enable_gqa`` (3-D inputs or the flag with a mask leave only
    SDPA's math kernel, every score in float32)."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, mask=None, **kwargs):
        calls.append((q.dim(), k.shape[1], mask.dim(), sorted(kwargs)))
        return sdpa(q, k, v, mask, **kwargs)

    monkeypatch.setattr(packed.F, "scaled_dot_product_attention", spy)
    q, k = torch.randn(4, 9, 8), torch.randn(2, 9, 8)
    packed._by_sequence(q, k, k, torch.tensor([0, 4, 9], dtype=torch.int32), 0.3)
    assert calls == [(4, 4, 4, ["scale"])]
