"""Flattened batches (transformers' ``DataCollatorWithFlattening``: a batch's sequences end to end in one row,
positions restarting at each, no padding mask): with every default, roundpipe cuts them between their
sequences into packed micro-batches (issue 39) instead of running the whole row as one micro-batch under a
dense mask; training equals plain Lightning on the same batches; a batch it cannot cut exactly, or a model
that cannot be packed, runs as its rows, with a warning."""

from __future__ import annotations

import pytest
import torch
from helpers import relative_error
from test_packed import assert_packed_from
from test_tokens import LM, fit, flat, instruction_batch, staleness_one_reference
from torch.utils.data import DataLoader

transformers = pytest.importorskip("transformers")

from lightning_roundpipe import RoundPipeStrategy  # noqa: E402
from lightning_roundpipe.models import hf  # noqa: E402
from lightning_roundpipe.models.hf import packed  # noqa: E402
from lightning_roundpipe.models.hf.tokens import TokenSplit  # noqa: E402


def flattened(batch: dict[str, torch.Tensor], separator: int = -100, **options) -> dict[str, torch.Tensor]:
    """A padded batch's sequences through transformers' flattening collator, as a user's data loader makes them."""
    items = []
    for r in range(batch["input_ids"].shape[0]):
        n = int(batch["attention_mask"][r].sum())
        items.append({"input_ids": batch["input_ids"][r, :n].tolist(), "labels": batch["labels"][r, :n].tolist()})
    collate = transformers.DataCollatorWithFlattening(return_position_ids=True, separator_id=separator, **options)
    return collate(items)


def flat_batches(steps: int = 4, rows: int = 8, separator: int = -100, **options) -> DataLoader:
    """``use_cache=False`` in each batch: with a cache (the config's default), transformers stops reading
    restarting positions as separate sequences, and plain training attends across them (roundpipe trains
    without a cache, so its result is the same either way)."""
    data = [dict(flattened(instruction_batch(rows, s), separator, **options), use_cache=False) for s in range(steps)]
    return DataLoader(data, batch_size=None)


def inputs_of(batch: dict[str, torch.Tensor]) -> tuple:
    mask, positions = hf.plain_inputs(batch.get("attention_mask"), batch.get("position_ids"))
    return (batch["input_ids"], mask, positions, batch["labels"])


def test_a_flattened_batch_is_cut_between_its_sequences_into_packed_micro_batches():
    padded = instruction_batch(rows=12, seed=0)
    batch = flattened(padded)
    inputs = inputs_of(batch)
    split = TokenSplit(span=16.0)
    lengths = padded["attention_mask"].sum(1).tolist()
    assert split.samples(inputs, inputs[-1]) == 12  # the engine counts its sequences, not its one row
    micro, targets = split(inputs, inputs[-1], 4)
    assert len(micro) == 4 and all(t is m[3] for m, t in zip(micro, targets))
    assert sum(m[0].numel() for m in micro) == sum(lengths)
    assert_packed_from(padded, micro, split, inputs)


def test_positions_that_do_not_start_at_zero_travel_as_they_are():
    """A sequence starts wherever a position does not follow the one before by one (transformers' reading);
    its own positions are kept (a continuation chunk at 5, 6, 7 rotates as such)."""
    ids = torch.arange(10)[None] + 3
    positions = torch.tensor([[0, 1, 2, 5, 6, 7, 0, 1, 2, 3]])
    labels = ids.clone()
    labels[0, [3, 6]] = -100
    split = TokenSplit()
    assert packed.sequences(positions) == [(0, 0, 3), (0, 3, 3), (0, 6, 4)]
    micro, _ = split((ids, None, positions, labels), labels, 2)
    assert sorted(p for m in micro for p in m[2][0].tolist()) == sorted(positions[0].tolist())


def test_rows_of_one_sequence_each_are_still_cut_by_samples():
    ids = torch.arange(12).reshape(3, 4)
    positions = torch.arange(4).expand(3, 4).clone()
    positions[1] += 7  # not 0..T-1, so plain_inputs keeps them, but each row is still one sequence
    split = TokenSplit()
    assert split.samples((ids, None, positions, ids), ids) is None
    micro, _ = split((ids, None, positions, ids), ids, 3)
    assert [m[0].shape for m in micro] == [(1, 4)] * 3 and not any(packed.is_packed(m[1]) for m in micro)


@pytest.mark.parametrize("lora", [False, True])
def test_training_on_flattened_batches_with_every_default_equals_plain_lightning(monkeypatch, lora):
    """Four steps of eight flattened sequences, two workers, four micro-batches, synchronous, the default split:
    the weights equal plain Lightning's on the same batches; the micro-batches were packed; validation runs."""
    seen = []
    call = TokenSplit.__call__
    monkeypatch.setattr(TokenSplit, "__call__", lambda *a: seen.append(result := call(*a)) or result)
    plain, _ = fit("auto", 1, flat_batches(), lora)
    strategy = RoundPipeStrategy(num_microbatches=4, async_optimizer=False)
    ours, trainer = fit(strategy, 2, flat_batches(), lora, flat_batches(steps=1))
    assert relative_error(flat(ours), flat(plain)) <= 1e-5
    assert relative_error(flat(ours), flat(LM(lora))) > 1e-4  # it trained
    assert torch.isfinite(trainer.callback_metrics["val_loss"])
    rows = [m for micro, _ in seen for m in micro]
    assert len(rows) >= 16 and all(m[0].shape[0] == 1 and packed.is_packed(m[1]) for m in rows)


def test_the_collator_s_flash_keywords_are_taken_and_without_positions_explained():
    """``return_flash_attn_kwargs=True`` adds the sequences' bounds (plain transformers takes them): they say what
    the positions say, and are dropped; without the positions the error names what to keep."""
    data = flat_batches(steps=2, return_flash_attn_kwargs=True, return_seq_idx=True)
    assert {"cu_seq_lens_q", "seq_idx"} <= set(next(iter(data)))
    plain, _ = fit("auto", 1, data)
    ours, _ = fit(RoundPipeStrategy(num_microbatches=2, async_optimizer=False), 2, data)
    assert relative_error(flat(ours), flat(plain)) <= 1e-5
    bare = [{k: v for k, v in b.items() if k != "position_ids"} for b in data]
    with pytest.raises(ValueError, match="keep the collator's return_position_ids=True"):
        fit(RoundPipeStrategy(num_microbatches=2), 2, DataLoader(bare, batch_size=None))


@pytest.mark.timeout(120)
def test_asynchronous_training_on_flattened_batches_equals_the_staleness_one_reference():
    ours, _ = fit(RoundPipeStrategy(num_microbatches=4), 2, flat_batches())
    assert relative_error(flat(ours), flat(staleness_one_reference(flat_batches()))) <= 1e-5


def test_a_flattened_batch_that_cannot_be_cut_exactly_runs_as_its_row_with_a_warning():
    """Labels on the sequences' first tokens (``separator_id`` other than -100): plain training predicts each
    from the sequence before; a cut would drop those terms, so the row runs whole (and equals plain)."""
    plain, _ = fit("auto", 1, flat_batches(steps=2, separator=7))
    with pytest.warns(UserWarning, match="first token has a label"):
        ours, _ = fit(RoundPipeStrategy(num_microbatches=2, async_optimizer=False), 2, flat_batches(2, separator=7))
    assert relative_error(flat(ours), flat(plain)) <= 1e-5


def test_a_model_that_cannot_be_packed_runs_a_flattened_batch_as_its_row_with_a_warning(monkeypatch):
    import test_tokens
    from test_hf import tiny

    class EagerLM(LM):
        def __init__(self, lora: bool = False):
            super().__init__(lora)
            self.model = tiny("qwen3", attn="eager")

    monkeypatch.setattr(test_tokens, "LM", EagerLM)
    plain, _ = fit("auto", 1, flat_batches(steps=2))
    with pytest.warns(UserWarning, match=r"attention other than SDPA .* runs as one micro-batch"):
        ours, _ = fit(RoundPipeStrategy(num_microbatches=2, async_optimizer=False), 2, flat_batches(steps=2))
    assert relative_error(flat(ours), flat(plain)) <= 1e-5


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_flattened_batches_on_a_gpu_run_torch_s_flash_kernel_in_compiled_blocks(monkeypatch, recwarn):
    """Under ``Trainer`` on the GPU with every default (bf16-mixed, blocks compiled): the flattened batches'
    micro-batches go through torch's varlen flash kernel, never SDPA with a mask (the flash path is what the
    compiled blocks traced), no block fell back to eager, and the weights moved within bf16 rounding of plain
    Lightning's on the same batches."""
    from test_packed import GpuLM, spy_on_flash, train_on_a_gpu

    from lightning_roundpipe.runtime.compiles import compilations

    if packed._VARLEN is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    flash = spy_on_flash(monkeypatch)
    plain = train_on_a_gpu("auto", flat_batches(steps=3))
    before = compilations()
    ours = train_on_a_gpu(RoundPipeStrategy(async_optimizer=False, num_microbatches=3), flat_batches(steps=3))
    assert flash and all(flash)
    assert 0 < compilations() - before <= 4
    assert not [str(w.message) for w in recwarn if "could not compile" in str(w.message)]
    start = flat(GpuLM())
    assert relative_error(flat(ours) - start, flat(plain) - start) <= 0.1
