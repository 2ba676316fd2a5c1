"""Micro-batches by tokens (issue 39): a Hugging Face model's padded batches are cut into micro-batches of
similar lengths, each trimmed to its longest row, their costs balanced; training equals plain Lightning's on
batches of a new length every step with -100 prompts, with LoRA and with equal lengths, asynchronously the
staleness-one reference; the micro-batches carry less padding than the batch."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import relative_error
from test_hf import VOCAB, tiny
from torch.utils.data import DataLoader

transformers = pytest.importorskip("transformers")

from lightning_roundpipe import RoundPipeStrategy  # noqa: E402
from lightning_roundpipe.models import hf  # noqa: E402
from lightning_roundpipe.models.hf.tokens import TokenSplit, padding_tokens  # noqa: E402


def instruction_batch(rows: int, seed: int, shortest: int = 3, longest: int = 24) -> dict[str, torch.Tensor]:
    """Sequences of lengths drawn from ``shortest..longest``, right-padded to the batch's longest (mask 0,
    label -100), the first quarter of each (its prompt) labelled -100."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shortest, longest + 1, (rows,), generator=g)
    width = int(lengths.max())
    input_ids = torch.randint(3, VOCAB, (rows, width), generator=g)
    attention_mask = (torch.arange(width) < lengths[:, None]).long()
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    for r, length in enumerate(lengths.tolist()):
        labels[r, : max(1, length // 4)] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def as_inputs(batch: dict[str, torch.Tensor]) -> tuple:
    mask, positions = hf.plain_inputs(batch["attention_mask"], batch.get("position_ids"))
    return (batch["input_ids"], mask, positions, batch["labels"])


def test_rows_of_similar_lengths_go_together_trimmed_and_their_costs_balanced():
    batch = instruction_batch(rows=12, seed=0)
    inputs = as_inputs(batch)
    split = TokenSplit(span=16.0)
    micro, targets = split(inputs, inputs[-1], 4)
    assert len(micro) == 4 and all(t is m[-1] for m, t in zip(micro, targets))
    rows = sorted(r for group in split.groups(hf.tokens.kept_lengths(*inputs[1::2]).tolist(), 4) for r in group)
    assert rows == list(range(12))  # every row once
    lengths = batch["attention_mask"].sum(1)
    for ids, mask, _, _ in micro:
        width = ids.shape[1]
        # trimmed to its own longest row: its last column is some row's real token
        assert mask is None or bool(mask[:, -1].any())
        assert width <= int(lengths.max())
    real = int(batch["attention_mask"].sum())
    assert padding_tokens(micro, real) < int((batch["attention_mask"] == 0).sum())  # less padding than the batch
    # right padding, unlabelled: the padding masks are left out (the causal mask alone is exact)
    assert all(mask is None for _, mask, _, _ in micro)
    assert sum(int((labels != -100).sum()) for *_, labels in micro) == int((batch["labels"] != -100).sum())
    costs = [split.cost(m[0].shape[0], m[0].shape[1]) for m in micro]
    total = sum(split.cost(1, int(n)) for n in lengths)  # every row alone, unpadded: no grouping does better
    assert max(costs) <= 2 * total / 4  # balanced within twice the mean (contiguous runs of sorted rows)


def test_the_split_says_what_any_count_of_micro_batches_would_hold_without_cutting():
    """The planner's padding at counts it has not run: exactly what the split makes, and less padding the more
    micro-batches (each trimmed to its own longest row)."""
    from lightning_roundpipe.runtime.microbatch import input_elements

    batch = instruction_batch(rows=12, seed=3, longest=40)
    inputs = as_inputs(batch)
    split = TokenSplit(span=16.0)
    at = split.sizes(inputs, inputs[-1])
    for num in (1, 2, 3, 5, 12):
        micro, _ = split(inputs, inputs[-1], num)
        assert at(num) == [input_elements(m) for m in micro]
    totals = [sum(at(num)) for num in (1, 2, 4, 12)]
    assert totals == sorted(totals, reverse=True) and totals[0] > totals[-1]
    assert at(40) == at(12)  # more micro-batches than rows: one row each
    full = dict(batch, attention_mask=torch.ones_like(batch["attention_mask"]), labels=batch["input_ids"])
    assert split.sizes(as_inputs(full), full["labels"]) is None  # split by samples: nothing to say


def test_a_batch_without_padding_or_with_a_label_in_the_padding_is_cut_by_samples_or_not_trimmed():
    unpadded = {"input_ids": torch.randint(3, VOCAB, (6, 8)), "attention_mask": torch.ones(6, 8, dtype=torch.long)}
    unpadded["labels"] = unpadded["input_ids"].clone()
    inputs = as_inputs(unpadded)
    assert inputs[1] is None
    micro, _ = TokenSplit()(inputs, inputs[-1], 3)
    assert [m[0].shape for m in micro] == [torch.Size([2, 8])] * 3  # as split_batch cuts it
    batch = instruction_batch(rows=4, seed=1)
    batch["labels"][:, -1] = 7  # a label on a padded position: plain training counts it, so it stays
    inputs = as_inputs(batch)
    micro, _ = TokenSplit()(inputs, inputs[-1], 2)
    assert all(m[0].shape[1] == batch["input_ids"].shape[1] for m in micro)
    assert any(m[1] is not None for m in micro)  # a labelled padded position: its prediction reads the mask
    left = instruction_batch(rows=4, seed=2)
    left = {k: v.flip(1) for k, v in left.items()}  # left padding: the causal mask alone would let tokens see it
    left["labels"] = left["input_ids"].masked_fill(left["attention_mask"] == 0, -100)
    inputs = as_inputs(left)
    micro, _ = TokenSplit()(inputs, inputs[-1], 2)
    assert any(m[1] is not None for m in micro)  # the padding mask stays


class LM(L.LightningModule):
    def __init__(self, lora: bool = False):
        super().__init__()
        self.model = tiny("qwen3")
        if lora:
            peft = pytest.importorskip("peft")
            config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
            self.model = peft.get_peft_model(self.model, config)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(**batch).loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def batches(steps: int = 4, rows: int = 8, **lengths) -> DataLoader:
    return DataLoader([instruction_batch(rows, seed=s, **lengths) for s in range(steps)], batch_size=None)


def fit(strategy, devices, data, lora=False, val=None, **kwargs):
    L.seed_everything(0, verbose=False)
    module = LM(lora)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs,
    )  # fmt: skip
    trainer.fit(module, data, val)
    return module, trainer


def flat(module):
    return torch.cat([p.detach().flatten() for p in module.parameters()])


@pytest.mark.parametrize(
    ("lora", "lengths", "multiple"),
    # varying, LoRA, all of one length, widths rounded up to multiples of 8 (trailing padding columns added back)
    [(False, {}, 1), (True, {}, 1), (False, {"shortest": 12, "longest": 12}, 1), (False, {}, 8)],
)
def test_training_by_tokens_equals_plain_lightning(monkeypatch, lora, lengths, multiple):
    """Four steps of eight sequences of new lengths each, two workers, four micro-batches, synchronous: the
    weights equal plain Lightning's; the micro-batches were cut by tokens (fewer columns than the batch)."""
    monkeypatch.setattr(TokenSplit, "width_multiple", multiple)
    seen = []
    split = TokenSplit.__call__
    widths = []  # each split batch's own width
    monkeypatch.setattr(
        TokenSplit, "__call__", lambda *a: widths.append(a[1][0].shape[1]) or seen.append(result := split(*a)) or result
    )
    plain, _ = fit("auto", 1, batches(**lengths), lora)
    strategy = RoundPipeStrategy(num_microbatches=4, async_optimizer=False)
    ours, trainer = fit(strategy, 2, batches(**lengths), lora, batches(steps=1, **lengths))
    assert relative_error(flat(ours), flat(plain)) <= 1e-5
    assert relative_error(flat(ours), flat(LM(lora))) > 1e-4  # it trained
    assert torch.isfinite(trainer.callback_metrics["val_loss"])
    trimmed = sum(m[0].numel() for micro, _ in seen for m in micro)
    if lengths:  # one length: nothing to trim
        assert all(m[0].shape[1] == 12 for micro, _ in seen for m in micro)
    elif multiple > 1:  # rounded up, never past the batch's own width
        cut = [(m[0].shape[1], width) for (micro, _), width in zip(seen, widths) for m in micro]
        assert all(w % multiple == 0 or w == width for w, width in cut) and all(w <= width for w, width in cut)
        assert any(w < width for w, width in cut)
    else:
        padded = sum(b["input_ids"].numel() for b in batches()) + batches(steps=1).dataset[0]["input_ids"].numel() * 2
        assert trimmed < 0.9 * padded


def test_split_by_samples_is_honoured_and_an_nn_sequential_cannot_ask_for_tokens():
    from lightning_roundpipe.discovery import pipelined_layers
    from lightning_roundpipe.options import RoundPipeOptions

    assert pipelined_layers(LM(), RoundPipeOptions(split_by="samples"), cuda=False).split is None
    assert isinstance(pipelined_layers(LM(), RoundPipeOptions(), cuda=False).split, TokenSplit)
    plain, _ = fit("auto", 1, batches(steps=2))
    ours, _ = fit(RoundPipeStrategy(num_microbatches=4, async_optimizer=False, split_by="samples"), 2,
                  batches(steps=2))  # fmt: skip
    assert relative_error(flat(ours), flat(plain)) <= 1e-5
    from helpers import BoringPipeline, boring_data

    with pytest.raises(ValueError, match=r"split_by='tokens'\) cuts a Hugging Face model's padded token batches"):
        L.Trainer(strategy=RoundPipeStrategy(split_by="tokens"), accelerator="cpu", devices=2, max_steps=1,
                  logger=False, enable_progress_bar=False).fit(BoringPipeline(), boring_data())  # fmt: skip


def staleness_one_reference(data: DataLoader) -> LM:
    """The module after AdamW steps whose gradients come from the weights one update old."""
    L.seed_everything(0, verbose=False)
    reference = LM()
    current, lagged = reference.model, copy.deepcopy(reference.model)
    opt = torch.optim.AdamW(current.parameters(), lr=1e-2)
    for batch in data:
        lagged.zero_grad()
        lagged(**batch).loss.backward()
        for p, q in zip(current.parameters(), lagged.parameters()):
            p.grad = q.grad.clone()
        before_update = copy.deepcopy(current.state_dict())
        opt.step()
        lagged.load_state_dict(before_update)
    return reference


@pytest.mark.timeout(120)
def test_asynchronous_training_by_tokens_equals_the_staleness_one_reference():
    ours, _ = fit(RoundPipeStrategy(num_microbatches=4), 2, batches())
    assert relative_error(flat(ours), flat(staleness_one_reference(batches()))) <= 1e-5


def test_mse_of_a_sequential_is_still_split_by_samples():
    """An nn.Sequential keeps the split along dim 0 (its loss's weights are the samples')."""
    from helpers import BoringPipeline, boring_data

    from lightning_roundpipe.engine import PipelineEngine
    from lightning_roundpipe.runtime import WorkerDevice

    model = BoringPipeline().model
    engine = PipelineEngine(list(model.children()), [WorkerDevice("cpu", 0)], microbatches_per_round=3)
    try:
        x, y = next(iter(boring_data()))
        loss = engine.train_batch(x, y, F.mse_loss)
    finally:
        engine.close()
    assert relative_error(loss, F.mse_loss(model(x), y).detach()) <= 1e-6


def test_token_type_ids_a_model_does_not_take_are_ignored_as_plain_transformers_ignores_them():
    """Some tokenizers return ``token_type_ids``; Qwen3's forward does not name them and its layers ignore them."""

    def with_types(loader):
        return DataLoader([dict(b, token_type_ids=torch.zeros_like(b["input_ids"])) for b in loader], batch_size=None)

    plain, _ = fit("auto", 1, with_types(batches(steps=2)))
    ours, _ = fit(RoundPipeStrategy(num_microbatches=2, async_optimizer=False), 2, with_types(batches(steps=2)))
    assert relative_error(flat(ours), flat(plain)) <= 1e-5


def test_a_split_that_cuts_another_count_than_asked_is_refused_at_the_cut():
    """The schedule holds the count asked: a micro-batch beyond it would never run, and the batch's loss would
    miss it only at the end (as the packed cut's rounding did on Python 3.12)."""
    from lightning_roundpipe.runtime.microbatch import cut

    inputs = as_inputs(instruction_batch(rows=4, seed=0))
    assert len(cut(TokenSplit(), inputs, inputs[-1], 2, "2 micro-batches")[0]) == 2
    one_more = lambda i, t, num: TokenSplit()(i, t, num + 1)  # noqa: E731
    with pytest.raises(RuntimeError, match=r"cut a batch into 3 micro-batches \(3 targets\) for 2 micro-batches"):
        cut(one_more, inputs, inputs[-1], 2, "2 micro-batches")
