"""``Trainer(strategy="roundpipe")`` trains exactly like plain Lightning, and refuses what it cannot do."""

from __future__ import annotations

import threading
from functools import partial

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import BoringPipeline, boring_data, fit, flat_weights, relative_error
from torch import nn

import lightning_roundpipe
from lightning_roundpipe import RoundPipeStrategy, StagePlan

CPU = {"accelerator": "cpu"}
SYNC = partial(RoundPipeStrategy, async_optimizer=False)  # the numerics of plain training


def test_registered_under_its_name_and_reimport_is_harmless():
    import importlib

    from lightning.pytorch.strategies import StrategyRegistry

    assert "roundpipe" in StrategyRegistry
    importlib.reload(lightning_roundpipe)
    assert StrategyRegistry["roundpipe"]["strategy"].__name__ == "RoundPipeStrategy"


@pytest.mark.parametrize(
    ("strategy", "devices", "extra"),
    [
        (SYNC, 1, {}),
        (SYNC, 2, {}),
        (partial(SYNC, num_microbatches=4), 3, {}),
        # forward and backward partitions differ; 2 rounds per batch
        (partial(SYNC, num_microbatches=3, num_rounds=2, plan="3,2,2|2,1,3,3"), 3, {}),
        (partial(SYNC, num_microbatches=3, plan=StagePlan.parse("1,1,1,1,1,1|3,3,3")), 2,
         {"accumulate_grad_batches": 2}),
        (SYNC, 2, {"gradient_clip_val": 0.05}),
        (SYNC, 3, {"gradient_clip_val": 0.5, "gradient_clip_algorithm": "value", "accumulate_grad_batches": 3}),
    ],
)  # fmt: skip
def test_weights_equal_plain_training(strategy, devices, extra):
    # 96 samples / batch 12 = 8 batches: at least 3 optimizer steps in every case
    plain = fit(BoringPipeline, {**CPU, "devices": 1, **extra})
    ours = fit(
        BoringPipeline,
        {**CPU, "devices": devices, "strategy": strategy() if callable(strategy) else strategy, **extra},
    )
    assert relative_error(flat_weights(ours), flat_weights(plain)) <= 1e-5
    assert relative_error(flat_weights(ours), flat_weights(BoringPipeline())) > 1e-2, "nothing was trained"
    # hooks saw the pipeline's gradients, at every optimizer step
    assert len(ours.seen_grad_norms) == len(plain.seen_grad_norms) >= 3
    assert ours.seen_grad_norms == pytest.approx(plain.seen_grad_norms, rel=1e-5)


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize(("samples", "batch_size"), [(26, 12), (5, 1)])
def test_a_short_last_batch_and_batch_size_one_train_like_plain_lightning(devices, samples, batch_size):
    """Lightning's default ``drop_last=False`` leaves a last batch smaller than the micro-batch count (26 =
    12 + 12 + 2), and long sequences come one at a time: both run as fewer micro-batches, as plain does."""
    data = boring_data(samples, batch_size)
    plain = fit(BoringPipeline, {**CPU, "devices": 1, "max_epochs": 2}, data)
    ours = fit(BoringPipeline, {**CPU, "devices": devices, "strategy": SYNC(), "max_epochs": 2}, data)
    assert relative_error(flat_weights(ours), flat_weights(plain)) <= 1e-5
    assert ours.seen_grad_norms == pytest.approx(plain.seen_grad_norms, rel=1e-5)


def test_fused_adamw_and_step_lr_scheduler():
    factory = partial(BoringPipeline, fused=True, scheduler=True)
    plain = fit(factory, {**CPU, "devices": 1, "max_epochs": 2})
    ours = fit(factory, {**CPU, "devices": 2, "strategy": SYNC(), "max_epochs": 2})
    assert relative_error(flat_weights(ours), flat_weights(plain)) <= 1e-5


def test_one_process_one_rank_no_distributed_sampler():
    seen = {}

    class Probe(BoringPipeline):
        def on_train_start(self):
            seen["world_size"] = self.trainer.world_size
            seen["sampler"] = type(self.trainer.train_dataloader.sampler).__name__
            seen["workers"] = self.trainer.strategy.engine.num_workers
            seen["device"] = self.model[0].weight.device.type

    fit(Probe, {**CPU, "devices": 3, "strategy": "roundpipe"})
    assert seen == {"world_size": 1, "sampler": "SequentialSampler", "workers": 3, "device": "cpu"}
    assert not [t for t in threading.enumerate() if t.name.startswith("roundpipe-worker")]


def test_validation_runs_and_logs_under_roundpipe():
    module = fit(BoringPipeline, {**CPU, "devices": 2, "strategy": "roundpipe", "limit_val_batches": 2},
                 data=None)  # fmt: skip
    trainer = module.trainer
    assert "train_loss" in trainer.callback_metrics
    metrics = L.Trainer(logger=False, enable_progress_bar=False, strategy="roundpipe", devices=2, **CPU).validate(
        module, boring_data(), verbose=False
    )
    assert metrics and "val_loss" in metrics[0]


def test_bf16_mixed_trains_close_to_fp32():
    plain = fit(BoringPipeline, {**CPU, "devices": 1})
    ours = fit(BoringPipeline, {**CPU, "devices": 2, "strategy": SYNC(), "precision": "bf16-mixed"})
    assert all(p.dtype == torch.float32 for p in ours.parameters())
    assert relative_error(flat_weights(ours), flat_weights(plain)) <= 2e-2


def test_unsupported_settings_say_what_to_change():
    with pytest.raises(ValueError, match=r"precision='16-true'\)` is not supported.*'32-true', 'bf16-mixed',\s+"):
        L.Trainer(strategy="roundpipe", precision="16-true", **CPU)
    with pytest.raises(ValueError, match="num_microbatches=0"):
        RoundPipeStrategy(num_microbatches=0)
    with pytest.raises(ValueError, match=r"planner='quick'\) must be one of \('objective', 'fastest'\)"):
        RoundPipeStrategy(planner="quick")
    with pytest.raises(ValueError, match="replan_margin above 0"):
        RoundPipeStrategy(replan_margin=0)
    with pytest.raises(ValueError, match="check_every must be at least 0"):
        RoundPipeStrategy(check_every=-1)
    with pytest.raises(TypeError, match=r"timeout='1h'\) takes a datetime.timedelta or a number of seconds"):
        RoundPipeStrategy(timeout="1h")
    with pytest.raises(ValueError, match="must be positive"):
        RoundPipeStrategy(timeout=0)
    assert RoundPipeStrategy(timeout=90).options.timeout.total_seconds() == 90


def test_model_without_a_sequential_is_refused():
    class NoSequential(BoringPipeline):
        def __init__(self):
            super().__init__()
            self.model = nn.Linear(8, 4)

    with pytest.raises(ValueError, match=r"holds none.*nn.Sequential"):
        fit(NoSequential, {**CPU, "devices": 2, "strategy": "roundpipe"})


def test_split_decoder_layers_without_a_hugging_face_model_is_refused():
    strategy = RoundPipeStrategy(split_decoder_layers=True)
    with pytest.raises(ValueError, match=r"split_decoder_layers=True.*Hugging Face.*split its blocks"):
        fit(BoringPipeline, {**CPU, "devices": 2, "strategy": strategy})


def test_trainable_parameters_outside_the_sequential_are_named():
    class Stray(BoringPipeline):
        def __init__(self):
            super().__init__()
            self.temperature = nn.Parameter(torch.ones(()))

    with pytest.raises(ValueError, match=r"outside `model`: \['temperature'\].*freeze them"):
        fit(Stray, {**CPU, "devices": 2, "strategy": "roundpipe"})


def test_loss_not_from_pipeline_loss_is_refused():
    class Direct(BoringPipeline):
        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.model(x), y)

    with pytest.raises(RuntimeError, match=r"must compute its loss with\s+`lightning_roundpipe.pipeline_loss"):
        fit(Direct, {**CPU, "devices": 2, "strategy": "roundpipe"})


def test_changed_loss_is_refused():
    class Scaled(BoringPipeline):
        def training_step(self, batch, batch_idx):
            return 2 * super().training_step(batch, batch_idx)

    with pytest.raises(RuntimeError, match="not the value `pipeline_loss` computed"):
        fit(Scaled, {**CPU, "devices": 2, "strategy": "roundpipe"})


def test_manual_optimization_is_refused():
    class Manual(BoringPipeline):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(ValueError, match="automatic optimization only") as refused:
        fit(Manual, {**CPU, "devices": 2, "strategy": "roundpipe"})
    assert "groups of one optimizer" in str(refused.value)  # what to do instead


def test_two_optimizers_are_refused_with_what_to_do_instead():
    """Lightning's own message sends the user to manual optimization, which roundpipe refuses: ours says to use
    parameter groups of one optimizer."""

    class Two(BoringPipeline):
        def configure_optimizers(self):
            params = list(self.parameters())
            return [torch.optim.SGD(params[:2], lr=0.1), torch.optim.SGD(params[2:], lr=0.1)]

    with pytest.raises(ValueError, match="groups of one optimizer") as refused:
        fit(Two, {**CPU, "devices": 2, "strategy": "roundpipe"})
    assert "manual optimization is not supported" in str(refused.value)


_EXPLODE = {"after": -1, "calls": 0}


class Exploding(nn.Module):
    """Identity that raises once it ran ``_EXPLODE["after"]`` times with grad (replicas share the dict)."""

    def forward(self, x):
        if torch.is_grad_enabled() and _EXPLODE["after"] >= 0:
            _EXPLODE["calls"] += 1
            if _EXPLODE["calls"] > _EXPLODE["after"]:
                raise ArithmeticError("layer exploded")
        return x


@pytest.mark.timeout(60)
def test_worker_failure_stops_fit_and_a_new_fit_works():
    class Failing(BoringPipeline):
        def __init__(self):
            super().__init__()
            self.model.insert(3, Exploding())

    _EXPLODE.update(after=5, calls=0)
    try:
        with pytest.raises(ArithmeticError, match="layer exploded"):
            fit(Failing, {**CPU, "devices": 2, "strategy": "roundpipe"})
    finally:
        _EXPLODE.update(after=-1, calls=0)
    assert not [t for t in threading.enumerate() if t.name.startswith("roundpipe-worker")]
    plain = fit(Failing, {**CPU, "devices": 1})
    ours = fit(Failing, {**CPU, "devices": 2, "strategy": SYNC()})
    assert relative_error(flat_weights(ours), flat_weights(plain)) <= 1e-5


def test_pytorch_lightning_twin():
    pl = pytest.importorskip("pytorch_lightning")

    class PLModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))

        def training_step(self, batch, batch_idx):
            return lightning_roundpipe.pipeline_loss(self.model, *batch, F.mse_loss)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    twin = pl.strategies.StrategyRegistry["roundpipe"]["strategy"]
    assert issubclass(twin, pl.strategies.Strategy)
    results = []
    for strategy in ("auto", twin(async_optimizer=False)):
        pl.seed_everything(0, verbose=False)
        module = PLModule()
        pl.Trainer(strategy=strategy, devices=1 if strategy == "auto" else 2, max_epochs=1, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, **CPU).fit(module, boring_data())  # fmt: skip
        results.append(flat_weights(module))
    assert relative_error(results[1], results[0]) <= 1e-5


def test_gpu_memory_option_reads_fractions_bytes_and_sizes():
    from lightning_roundpipe.options import device_memory_limit, parse_memory

    assert RoundPipeStrategy(gpu_memory="24GiB").options.gpu_memory == 24 * 2**30
    assert RoundPipeStrategy(gpu_memory="20 GB").options.gpu_memory == 20e9
    assert RoundPipeStrategy(gpu_memory=0.5).options.gpu_memory == 0.5
    assert parse_memory("0.6") == 0.6 and parse_memory(2**30) == 2**30
    for bad in ("lots", "24 GiBs", 0, -1.0, "0.5B"):
        with pytest.raises(ValueError, match="gpu_memory"):
            RoundPipeStrategy(gpu_memory=bad)
    assert device_memory_limit([torch.device("cpu")], 2**30) is None  # nothing limits a CPU stage


def test_compiled_model_is_refused_with_what_to_change():
    class Compiled(BoringPipeline):
        def __init__(self):
            super().__init__()
            self.model = torch.compile(self.model)

    with pytest.raises(ValueError, match=r"torch\.compile.*Remove"):
        fit(Compiled, {**CPU, "devices": 2, "strategy": "roundpipe"})


@pytest.mark.parametrize("async_optimizer", [False, True])
def test_non_finite_loss_stops_before_the_update(async_optimizer):
    class Diverging(BoringPipeline):
        def training_step(self, batch, batch_idx):
            x, y = batch
            if self.trainer.global_step == 2:
                x = x * float("nan")
            return lightning_roundpipe.pipeline_loss(self.model, x, y, F.mse_loss)

    module = Diverging()
    seen = []

    class Keep(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            seen.append(flat_weights(pl_module).clone())

    strategy = RoundPipeStrategy(num_microbatches=3, async_optimizer=async_optimizer)
    trainer = L.Trainer(
        **CPU,
        devices=2,
        strategy=strategy,
        max_epochs=1,
        callbacks=[Keep()],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    with pytest.raises(FloatingPointError, match=r"step 2 is nan.*Lower the learning rate"):
        trainer.fit(module, boring_data())
    assert torch.isfinite(flat_weights(module)).all()  # no non-finite update reached the weights
    assert len(seen) == 2


def test_inputs_of_the_wrong_dtype_name_the_worker_and_the_dtypes():
    class Doubles(BoringPipeline):
        def training_step(self, batch, batch_idx):
            x, y = batch
            return lightning_roundpipe.pipeline_loss(self.model, x.double(), y, F.mse_loss)

    with pytest.raises(RuntimeError, match=r"(?i)double.*float|float.*double") as info:
        fit(Doubles, {**CPU, "devices": 2, "strategy": "roundpipe"})
    assert "raised by roundpipe worker" in "".join(getattr(info.value, "__notes__", []))


class _FirstLayerFrozen(BoringPipeline):
    def __init__(self) -> None:
        super().__init__()
        self.model[0].requires_grad_(False)
        self.backbone = self.model[0]  # what BackboneFinetuning unfreezes

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


class _Unfreeze(L.Callback):
    """What Lightning's BackboneFinetuning does at its epoch (``at_batch``: in the middle of one instead)."""

    def __init__(self, at_batch: int | None = None) -> None:
        self.at_batch = at_batch

    def _unfreeze(self, trainer, pl_module) -> None:
        pl_module.model[0].requires_grad_(True)
        trainer.optimizers[0].add_param_group({"params": list(pl_module.model[0].parameters()), "lr": 1e-2})

    def on_train_epoch_start(self, trainer, pl_module):
        if self.at_batch is None and trainer.current_epoch == 1:
            self._unfreeze(trainer, pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.at_batch is not None and trainer.current_epoch == 0 and batch_idx == self.at_batch:
            self._unfreeze(trainer, pl_module)


@pytest.mark.timeout(180)
def test_a_layer_unfrozen_between_steps_trains_as_in_plain_lightning():
    """The engine is built for the parameters trainable when fit starts: a layer unfrozen later kept its weights
    while plain Lightning trained it (silently, 13% of the layer apart after an epoch). Between optimizer steps the
    strategy builds the engine again for the new set: equal to plain Lightning synchronously, with our callback and
    with Lightning's BackboneFinetuning; the asynchronous runs train it too, the same on the host and the device."""
    from lightning.pytorch.callbacks import BackboneFinetuning

    kwargs = {"accelerator": "cpu", "devices": 1, "max_epochs": 2}
    for callback in (_Unfreeze, lambda: BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda e: 1.0)):
        plain = fit(_FirstLayerFrozen, {**kwargs, "callbacks": [callback()]})
        strategy = RoundPipeStrategy(num_microbatches=2, async_optimizer=False)
        ours = fit(_FirstLayerFrozen, {**kwargs, "callbacks": [callback()], "strategy": strategy})
        assert relative_error(flat_weights(ours), flat_weights(plain)) <= 1e-5
    start = fit(_FirstLayerFrozen, {**kwargs, "max_steps": 0})
    runs = {
        place: fit(_FirstLayerFrozen, {**kwargs, "callbacks": [_Unfreeze()], "strategy": RoundPipeStrategy(
            num_microbatches=2, optimizer_on=place)})
        for place in ("host", "device")
    }  # fmt: skip
    assert torch.equal(flat_weights(runs["host"]), flat_weights(runs["device"]))
    first = lambda m: torch.cat([p.detach().flatten() for p in m.model[0].parameters()])  # noqa: E731
    assert relative_error(first(runs["host"]), first(start)) > 1e-3  # the unfrozen layer trained


@pytest.mark.timeout(120)
def test_unfreezing_in_the_middle_of_an_accumulated_step_stops_saying_where_it_may():
    strategy = RoundPipeStrategy(num_microbatches=2)
    kwargs = {"accelerator": "cpu", "devices": 1, "accumulate_grad_batches": 2, "callbacks": [_Unfreeze(at_batch=3)]}
    with pytest.raises(ValueError, match=r"layers \[0\] were frozen or unfrozen .* middle of an accumulated step"):
        fit(_FirstLayerFrozen, {**kwargs, "strategy": strategy})


class _OwnClipping(BoringPipeline):
    calls = 0

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        type(self).calls += 1
        self.clip_gradients(optimizer, gradient_clip_val=1e-3, gradient_clip_algorithm="value")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(  # (the fallback keeps the states on the host, and no spares: refused before it dropped them)
    "given", [{"optimizer_on": "auto"}, {"optimizer_on": "device"}, {"optimizer_on": 0.5}, {"double_buffer": "all"}]
)
def test_a_module_that_clips_its_own_way_trains_as_with_plain_lightning(given):
    """``configure_gradient_clipping`` needs the gradients on the main thread: the asynchronous default never called
    it (the run trained unclipped, silently). The fit falls back to the synchronous optimizer, saying why."""
    _OwnClipping.calls = 0
    plain = fit(_OwnClipping, {"accelerator": "cpu", "devices": 1})
    steps, _OwnClipping.calls = _OwnClipping.calls, 0
    with pytest.warns(UserWarning, match="overrides configure_gradient_clipping.*synchronous optimizer"):
        strategy = RoundPipeStrategy(num_microbatches=2, **given)
        ours = fit(_OwnClipping, {"accelerator": "cpu", "devices": 1, "strategy": strategy})
    assert _OwnClipping.calls == steps > 0
    assert relative_error(flat_weights(ours), flat_weights(plain)) <= 1e-5


class _WithBatchNorm(BoringPipeline):
    def __init__(self, frozen_norm: bool = False) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))
        self.frozen_norm = frozen_norm
        if frozen_norm:  # statistics of a pretrained model, kept as they are
            self.model[1].running_mean.uniform_(-0.1, 0.1)
            self.model[1].running_var.uniform_(0.5, 1.5)
            self.model[1].requires_grad_(False)

    def on_train_epoch_start(self) -> None:
        if self.frozen_norm:
            self.model[1].eval()


@pytest.mark.timeout(120)
def test_batch_norm_in_training_mode_is_refused_and_frozen_statistics_train_as_plain_lightning():
    """Batch norms update their running statistics in the forward: the workers did so on device copies that never
    came back (the module kept its initial statistics, 97% away from plain Lightning's after an epoch, and
    evaluation used them), and each micro-batch normalised by its own statistics. They are refused in training
    mode; frozen (eval mode) they train as in plain Lightning."""
    strategy = RoundPipeStrategy(num_microbatches=2)
    with pytest.raises(ValueError, match=r"layers \[1\] hold batch norms in training mode"):
        fit(_WithBatchNorm, {"accelerator": "cpu", "devices": 1, "strategy": strategy})
    plain = fit(partial(_WithBatchNorm, True), {"accelerator": "cpu", "devices": 1})
    strategy = RoundPipeStrategy(num_microbatches=2, async_optimizer=False)
    ours = fit(partial(_WithBatchNorm, True), {"accelerator": "cpu", "devices": 1, "strategy": strategy})
    assert relative_error(flat_weights(ours), flat_weights(plain)) <= 1e-5
    assert torch.equal(ours.model[1].running_mean, plain.model[1].running_mean)


class _SpectralNorm(BoringPipeline):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.utils.parametrizations.spectral_norm(nn.Linear(8, 16))
        self.model = nn.Sequential(layer, nn.Tanh(), nn.Linear(16, 4))


@pytest.mark.timeout(120)
def test_a_forward_that_changes_its_buffers_in_place_is_said_once():
    """Spectral norm's power iteration updates buffers in each training forward; the workers' copies never come
    back, so the module keeps its first vectors. Not refused (the weights still train), but said, once a layer."""
    strategy = RoundPipeStrategy(num_microbatches=2)
    said = r"layer 0's forward changed its buffers \['parametrizations.weight.0._u'"
    with pytest.warns(UserWarning, match=said) as seen:
        fit(_SpectralNorm, {"accelerator": "cpu", "devices": 1, "strategy": strategy})
    assert len([w for w in seen if "changed its buffers" in str(w.message)]) == 1


class _SharedModules(BoringPipeline):
    """One activation object between every pair of layers, and one linear layer used three times (weights shared
    across depth): ``nn.Sequential.children()`` yields each only once."""

    def __init__(self) -> None:
        super().__init__()
        act, inner = nn.Tanh(), nn.Linear(16, 16)
        self.model = nn.Sequential(nn.Linear(8, 16), act, inner, act, inner, act, inner, nn.Linear(16, 4))


@pytest.mark.timeout(120)
def test_a_sequential_that_uses_a_module_twice_trains_as_plain_lightning():
    """The pipeline took the Sequential's children, which skip a module seen before: a shared activation ran once
    (another network: 3% apart from plain Lightning after an epoch) and a linear layer used three times once (26%).
    It takes every entry now, as the Sequential's own forward does."""
    plain = fit(_SharedModules, {"accelerator": "cpu", "devices": 1})
    strategy = RoundPipeStrategy(num_microbatches=2, async_optimizer=False)
    ours = fit(_SharedModules, {"accelerator": "cpu", "devices": 2, "strategy": strategy})
    assert relative_error(flat_weights(ours), flat_weights(plain)) <= 1e-5


class _SelfCheckpointed(nn.Module):
    """A block that checkpoints itself (``mode``: reentrant or not; ``None``: not at all), with a dropout inside."""

    def __init__(self, mode: str | None, p: float) -> None:
        super().__init__()
        self.linear, self.drop, self.mode = nn.Linear(16, 16), nn.Dropout(p), mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        body = lambda t: torch.tanh(self.drop(self.linear(t)))  # noqa: E731
        if self.mode is None:
            return body(x)
        return torch.utils.checkpoint.checkpoint(body, x, use_reentrant=self.mode == "reentrant")


class _WithOwnCheckpointing(BoringPipeline):
    def __init__(self, mode: str | None = "plain", p: float = 0.0) -> None:
        super().__init__()
        inner = [_SelfCheckpointed(mode, p) for _ in range(3)]
        self.model = nn.Sequential(nn.Linear(8, 16), *inner, nn.Linear(16, 4))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["plain", "reentrant"])
def test_layers_that_checkpoint_themselves_train_as_plain_lightning(mode):
    """torch.utils.checkpoint inside a layer recomputes its forward in the stage's backward: the worker keeps the
    layer's weights bound through it (their meta placeholders failed there before), in either checkpoint mode, one
    layer to a stage or several, the last stage's too. With a dropout inside, its recompute draws the forward's mask:
    equal to the same layers not checkpointing themselves (roundpipe seeds each layer's micro-batch: not plain's),
    with two CPU workers too (the recompute restores the forward's state into the generator they share)."""
    kwargs = {**CPU, "max_epochs": 2}
    plain = fit(partial(_WithOwnCheckpointing, mode), {**kwargs, "devices": 1})
    for devices, plan in ((1, None), (2, StagePlan.parse("3|2,3"))):
        strategy = partial(SYNC, num_microbatches=3, plan=plan)
        ours = fit(partial(_WithOwnCheckpointing, mode), {**kwargs, "devices": devices, "strategy": strategy()})
        assert relative_error(flat_weights(ours), flat_weights(plain)) <= 1e-5
        dropped = fit(
            partial(_WithOwnCheckpointing, mode, 0.25), {**kwargs, "devices": devices, "strategy": strategy()}
        )
        unchecked = fit(
            partial(_WithOwnCheckpointing, None, 0.25), {**kwargs, "devices": devices, "strategy": strategy()}
        )
        assert relative_error(flat_weights(dropped), flat_weights(unchecked)) <= 1e-6
        assert relative_error(flat_weights(dropped), flat_weights(ours)) > 1e-3  # (the dropout did act)
