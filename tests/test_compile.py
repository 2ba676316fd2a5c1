"""Regional compilation (``RoundPipeStrategy(compile=...)``): compiled blocks train as the model does, share
one compiled code across blocks, workers and sequence lengths, come off at teardown, and the batches that
compiled are not taken as measurements. CPU tests compile with ``aot_eager`` (no code generation: fast,
and the eager kernels' numbers); the GPU tests with the default backend."""

from __future__ import annotations

import copy
import shutil
import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import BoringPipeline, fit, flat_weights, relative_error
from torch import nn

from lightning_roundpipe import RoundPipeMonitor, RoundPipeStrategy
from lightning_roundpipe.engine import PipelineEngine
from lightning_roundpipe.models import compiled
from lightning_roundpipe.runtime import WorkerDevice

transformers = pytest.importorskip("transformers")
from lightning_roundpipe.models import hf  # noqa: E402

EAGER = {"backend": "aot_eager"}


class Counting:
    """A torch.compile backend that counts the graphs it is given and runs them as traced."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, inputs: list) -> object:
        self.graphs += 1
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward))(gm, inputs)


class Traced(Counting):
    """Counts the graphs and runs them as dynamo traced them, without AOT autograd's tracing of the backward:
    for tests about which variants dynamo makes, or about what happens around a compile (a compiled forward
    bound and taken off), not about its numbers: at a fraction of the time."""

    def __call__(self, gm: torch.fx.GraphModule, inputs: list) -> object:
        self.graphs += 1
        return gm.forward


def qwen3(layers: int = 3) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.Qwen3ForCausalLM(config)


def train(layers: list[nn.Module], lengths: list[int], workers: int = 2, **kwargs) -> tuple[list[float], object]:
    """Losses of one batch per sequence length through an engine of CPU workers, and the engine's planner."""
    engine = PipelineEngine(
        layers, [WorkerDevice("cpu", i) for i in range(workers)], microbatches_per_round=2, **kwargs
    )
    losses = []
    try:
        for s, length in enumerate(lengths):
            ids = torch.randint(0, 101, (4, length), generator=torch.Generator().manual_seed(s))
            losses.append(engine.train_batch((ids, None, None, ids), ids, lambda out, _: out, hf.counted_tokens).item())
            engine.store.clear_grads()
        return losses, engine.planner
    finally:
        engine.close()


@pytest.mark.timeout(240)
@pytest.mark.alongside  # compile-heavy: may run in a second process (tests/alongside.py)
@pytest.mark.parametrize("split", [False, True])
def test_compiled_blocks_train_to_the_weights_of_plain_lightning(split):
    from test_hf import fit_hf

    plain = fit_hf("auto", 1)
    counting = Counting()
    strategy = RoundPipeStrategy(
        num_microbatches=3, async_optimizer=False, compile={"backend": counting}, split_decoder_layers=split
    )
    ours = fit_hf(strategy, 2)
    assert counting.graphs >= 1  # the blocks did run compiled
    assert relative_error(flat_weights(ours), flat_weights(plain)) <= 1e-5
    assert strategy.engine is None and not any("forward" in m.__dict__ for m in ours.modules())  # taken off


@pytest.mark.timeout(240)
@pytest.mark.alongside  # compile-heavy: may run in a second process (tests/alongside.py)
def test_one_compiled_code_serves_every_block_worker_and_sequence_length():
    counting = Counting()
    few, many = hf.build_layers(qwen3(2)), hf.build_layers(qwen3(6))
    assert compiled.apply(many, compiled.compile_options({"backend": counting})) == ["Qwen3DecoderLayer x6"]
    train(many, [9, 9], plan="|8")  # one fused stage: the block's graph with autograd, once
    first = counting.graphs
    train(many, [10, 12, 14, 16], plan="3,3|2,3,3")  # forward stages: the graph without autograd
    assert 1 <= first <= 2 and counting.graphs <= first + 2  # not one per block, nor per length (dynamic)
    settled = counting.graphs
    train(many, [11, 13, 15, 9, 20], plan="3,3|2,3,3")
    assert counting.graphs == settled  # no new length compiles again

    counting_few = Counting()
    compiled.apply(few, compiled.compile_options({"backend": counting_few}))
    train(few, [9, 9], plan="|4")
    assert 1 <= counting_few.graphs <= first  # no more graphs for 6 blocks than for 2, beyond a retrace


@pytest.mark.timeout(240)
@pytest.mark.alongside  # compile-heavy: may run in a second process (tests/alongside.py)
def test_compiled_blocks_equal_eager_ones_through_the_engine():
    eager, model = qwen3(), qwen3()
    layers = hf.build_layers(model)
    counting = Counting()
    compiled.apply(layers, {"backend": counting})
    lengths = [9, 9, 12, 12]
    want, _ = train(hf.build_layers(eager), lengths, plan="2|3,2", seed=3)
    got, _ = train(layers, lengths, plan="2|3,2", seed=3)
    assert counting.graphs >= 2 and got == pytest.approx(want, rel=1e-6)


@pytest.mark.timeout(240)
def test_measuring_batches_during_which_something_compiled_are_not_used(monkeypatch):
    layers = hf.build_layers(qwen3(2))
    compiled.apply(layers, {"backend": Counting()})
    _, planner = train(layers, [8] * 6, plan="auto", profile_steps=2)
    assert planner.measuring is False and 1 <= planner._compiled_batches <= 2
    assert planner.fitted is not None and planner.fitted.batches == 2

    from lightning_roundpipe.engine import planner as planner_module

    ticks = iter(range(10**6))  # a compile during every batch: measuring still ends, twice as late at most
    monkeypatch.setattr(planner_module, "compile_mark", lambda: next(ticks))
    monkeypatch.setattr("lightning_roundpipe.runtime.flight.compile_mark", lambda: next(ticks))
    _, planner = train(hf.build_layers(qwen3(2)), [8] * 5, plan="auto", profile_steps=2)
    assert planner.measuring is False and planner._compiled_batches == 2


def test_a_user_patched_forward_is_left_alone_and_remove_restores_the_class_code():
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    own = lambda x: x  # noqa: E731
    net[1].forward = own
    counting = Counting()
    assert compiled.apply(list(net), {"backend": counting}) == ["Linear x2"]
    assert net[1].forward is own and "forward" in net[0].__dict__
    net(torch.randn(3, 4)).sum().backward()
    assert counting.graphs == 0  # the host's own modules run the class's code: only the workers' replicas compile
    copied = copy.deepcopy(net[0])  # a worker's replica: compiled, and bound to the copy
    assert copied.forward.__self__ is copied
    compiled.remove(list(net))
    assert "forward" not in net[0].__dict__ and net[1].forward is own


def test_defaults_are_dynamic_with_torchs_random_ops_and_cuda_graphs_are_refused():
    assert compiled.compile_options(True) == {"dynamic": True, "options": {"fallback_random": True}}
    assert compiled.compile_options({"backend": "aot_eager", "dynamic": False}) == {
        "backend": "aot_eager", "dynamic": False
    }  # fmt: skip
    assert compiled.compile_options({"mode": "max-autotune-no-cudagraphs"}) == {
        "dynamic": True, "mode": "max-autotune-no-cudagraphs"
    }  # fmt: skip
    for asked in ({"mode": "reduce-overhead"}, {"mode": "max-autotune"}, {"options": {"triton.cudagraphs": True}}):
        with pytest.raises(ValueError, match="CUDA graphs"):
            compiled.compile_options(asked)


@pytest.mark.timeout(240)
@pytest.mark.skipif(shutil.which("g++") is None, reason="Inductor's CPU code needs a C++ compiler")
def test_inductor_dropout_draws_the_masks_of_eager_in_forward_stages_and_recompute():
    """The forward stage runs the graph without autograd, the backward stage's recompute the one with it:
    under the default ``fallback_random`` both draw torch's own dropout masks from the layer's seed, so
    compiled training equals eager (Inductor's own random numbers differed from eager by 0.47 here)."""

    def gradients(plan: str, options: dict | None) -> torch.Tensor:
        torch.manual_seed(0)
        drop = lambda n: nn.Sequential(nn.Dropout(0.5), nn.Linear(16, n))  # noqa: E731
        net = nn.Sequential(nn.Linear(8, 16), drop(16), drop(4))
        if options is not None:
            compiled.apply(list(net), options)
        devices = [WorkerDevice("cpu", i) for i in range(2)]
        engine = PipelineEngine(list(net), devices, plan=plan, microbatches_per_round=2, seed=1)
        g = torch.Generator().manual_seed(0)
        try:
            engine.train_batch(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g), F.mse_loss)
            engine.store.install_grads()
            return torch.cat([p.grad.flatten() for p in net.parameters()])
        finally:
            engine.close()

    eager = gradients("|3", None)
    assert gradients("1|2,1", None).equal(eager)
    defaults = compiled.compile_options(True)
    assert torch.allclose(gradients("1|2,1", defaults), eager, atol=1e-6)  # a forward stage, then recompute
    assert torch.allclose(gradients("|3", defaults), eager, atol=1e-6)


def test_each_device_gets_its_own_compiled_code():
    """A tensor's device is in the guards: devices sharing one code would share its limit of variants."""
    counting = Counting()
    layers = [nn.Linear(4, 4), nn.Linear(4, 4)]
    compiled.apply(layers, compiled.compile_options({"backend": counting}))
    for layer, device in zip(layers, ("cuda:0", "cuda:1")):  # labels only: the tensors stay on the CPU
        layer._roundpipe_replica = device
    for _ in range(2):
        for layer in layers:
            layer(torch.randn(3, 4))
    assert counting.graphs == 2  # one per device, each reused
    layers[1]._roundpipe_replica = "cuda:0"
    layers[1](torch.randn(5, 4))
    assert counting.graphs == 2  # a second module on cuda:0 runs that device's code


def test_the_compile_count_survives_a_dynamo_reset():
    from lightning_roundpipe.runtime.compiles import compilations

    def count() -> int:
        fn = torch.compile(lambda x: x * 2 + 1, backend="eager")
        before = compilations()
        fn(torch.randn(3))
        return compilations() - before

    assert count() == 1
    torch._dynamo.reset()  # clears every compile callback, the counter's too
    assert count() == 1


def test_worker_threads_see_the_compile_settings_of_the_thread_that_made_them():
    from lightning_roundpipe.runtime.workers import WorkerPool

    seen = []
    with torch._dynamo.config.patch(recompile_limit=3):
        pool = WorkerPool(["roundpipe-worker-0"], [lambda: None], on_error=lambda e: None)
    try:
        assert pool.submit(0, lambda: seen.append(torch._dynamo.config.recompile_limit)).done.wait(30)
    finally:
        pool.close()
    assert seen == [3]


@pytest.mark.parametrize(
    ("value", "match"), [("yes", "must be 'auto', True, False or a dict"), ({"mdoe": "default"}, r"\['mdoe'\].*'mode'")]
)
def test_bad_compile_arguments_are_refused_when_the_strategy_is_made(value, match):
    with pytest.raises(ValueError, match=match):
        RoundPipeStrategy(compile=value)


@pytest.mark.timeout(240)
@pytest.mark.alongside  # compile-heavy: may run in a second process (tests/alongside.py)
def test_training_evaluation_unpadded_and_single_sample_batches_stay_within_torch_compiles_variant_limit():
    """A run makes more variants of a block than the 8 torch.compile keeps per code object (grad mode, training
    mode, a mask or none, a one-sample batch; a frozen embedding's ``requires_grad`` under LoRA); past the
    limit it would run eagerly with only a log line. Here reaching the limit fails instead, with LoRA."""
    from test_hf import padded_batch

    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(qwen3(2), peft.LoraConfig(r=2, target_modules="all-linear", lora_dropout=0.0))
    layers = hf.build_layers(model)
    compiled.apply(layers, compiled.compile_options({"backend": Traced(), "fullgraph": True}), fallback=True)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        engine = PipelineEngine(layers, [WorkerDevice("cpu", 0)], plan="auto", profile_steps=1, seed=0)

        def run(batch: dict, evaluate: bool = False) -> None:
            mask, positions = hf.plain_inputs(batch["attention_mask"], None)
            inputs = (batch["input_ids"] % 101, mask, positions, batch["labels"] % 101)
            if evaluate:
                model.eval()
                engine.begin_evaluation()
                engine.evaluate(inputs, inputs[-1], lambda out, _: out, hf.counted_tokens)
                engine.end_evaluation()
                model.train()
            else:
                engine.train_batch(inputs, inputs[-1], lambda out, _: out, reduction=hf.counted_tokens)
                engine.store.clear_grads()

        unpadded = padded_batch(6)
        unpadded["attention_mask"][:] = 1
        unpadded["labels"] = unpadded["input_ids"].clone()
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message="roundpipe: torch.compile")  # no fallback to eager either
                run(padded_batch(6), evaluate=True)  # Lightning's sanity check
                for seed in range(4):
                    run(padded_batch(6, seed=seed))
                for batch in (unpadded, padded_batch(1)):
                    run(batch)
                    run(batch, evaluate=True)
                run(padded_batch(6), evaluate=True)
        finally:
            engine.close()
            compiled.remove(layers)


def test_a_setup_that_fails_after_compiling_leaves_the_model_as_it_was_and_the_next_fit_compiles_again(monkeypatch):
    """The host memory check (or the nodes' agreement) fails after the blocks were compiled: the user's model
    keeps no compiled forward, and fitting again binds and removes them as a first fit does."""
    from test_hf import HFModule, hf_data

    import lightning_roundpipe.strategy as strategy_module

    module = HFModule()
    blocks = list(module.model.model.layers)

    def trainer() -> L.Trainer:
        strategy = RoundPipeStrategy(num_microbatches=2, compile={"backend": Traced()})
        return L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip

    def no_host_memory(*args, **kwargs):
        raise MemoryError("the host cannot hold this run")

    with monkeypatch.context() as patched:
        patched.setattr(strategy_module, "build_engine", no_host_memory)
        with pytest.raises(MemoryError, match="cannot hold"):
            trainer().fit(module, hf_data())
    assert not any("forward" in block.__dict__ for block in blocks)
    during: list[bool] = []
    seen = L.Callback()
    seen.on_train_batch_start = lambda *_: during.append(all("forward" in b.__dict__ for b in blocks))
    fitted = trainer()
    fitted.callbacks.append(seen)
    fitted.fit(module, hf_data())
    assert during == [True] and fitted.strategy.kernels == []  # compiled again, and no kernels on a CPU
    assert not any("forward" in block.__dict__ for block in blocks)  # and taken off at teardown


def refusing(gm: torch.fx.GraphModule, inputs: list) -> object:
    """A torch.compile backend that cannot compile anything."""
    raise RuntimeError("no code for this graph")


def first_batchs_error(backend: object) -> BaseException:
    """What the main thread gets from a first batch through blocks compiled with ``backend``."""
    layers = [nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)]
    compiled.apply(layers, compiled.compile_options({"backend": backend}))
    engine = PipelineEngine(layers, [WorkerDevice("cpu", 0)], microbatches_per_round=2)
    try:
        with pytest.raises(Exception) as failed:
            engine.train_batch(torch.randn(4, 4), torch.randn(4, 2), F.mse_loss)
    finally:
        engine.close()
    return failed.value


def test_a_block_that_cannot_compile_runs_eagerly_under_auto_and_fails_clearly_when_asked():
    """``compile="auto"`` must not stop a run that eager code would train: a class whose compile fails runs
    eagerly from then on, with one warning. Asked for explicitly, the failure reaches the main thread
    with what to change."""
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    compiled.apply(list(net), compiled.compile_options({"backend": refusing}), fallback=True)
    replica = copy.deepcopy(net)
    for module in replica:
        module._roundpipe_replica = "cpu"
    x = torch.randn(3, 4)
    with pytest.warns(UserWarning, match="could not compile Linear on cpu.*runs eagerly") as caught:
        assert torch.equal(replica(x), net(x))
        assert torch.equal(replica(x), net(x))  # eager now: no second attempt, no second warning
    assert sum("could not compile Linear" in str(w.message) for w in caught) == 1
    compiled.remove(list(net))

    error = first_batchs_error(refusing)
    assert "no code for this graph" in str(error) and any("compile=False" in note for note in error.__notes__)


def refusing_backwards(gm: torch.fx.GraphModule, inputs: list) -> object:
    """A backend whose forward graphs run and whose backward graphs cannot compile."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def refuse(graph: torch.fx.GraphModule, _: list) -> object:
        raise RuntimeError("no code for this backward graph")

    return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward), bw_compiler=refuse)(gm, inputs)


@pytest.mark.timeout(120)
def test_a_backward_that_fails_to_compile_at_the_first_backward_says_compile_false_helps():
    """Under ``dynamic=True`` AOTAutograd tries a backward graph with its forward, keeps quiet about a
    failure and compiles it again at the first backward, where it fails as a plain ``RuntimeError`` from
    inside torch.compile's code: the note still names the way out."""
    error = first_batchs_error(refusing_backwards)
    assert type(error) is RuntimeError and "no code for this backward graph" in str(error)
    assert any("compile=False" in note for note in error.__notes__)


HAS_SWITCH = hasattr(torch._functorch.config, "force_non_lazy_backward_lowering")


@pytest.mark.timeout(120)
@pytest.mark.skipif(not HAS_SWITCH, reason="this torch compiles backward graphs at the first backward only")
def test_under_auto_a_backward_that_cannot_compile_runs_eagerly_and_the_batch_trains():
    """``compile="auto"`` compiles a variant's backward graph with its forward, so a backward that cannot
    compile falls back with the forward, before anything ran, instead of failing the batch at its first
    backward: the batch trains to eager code's loss and gradients, with one warning."""
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)]
    plain = copy.deepcopy(layers)
    compiled.apply(layers, compiled.compile_options({"backend": refusing_backwards}), fallback=True)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    engine = PipelineEngine(layers, [WorkerDevice("cpu", 0)], microbatches_per_round=2)
    try:
        with pytest.warns(UserWarning, match="could not compile Linear on cpu.*backward graph.*runs eagerly"):
            loss = engine.train_batch(x, y, F.mse_loss)
        engine.store.install_grads()
    finally:
        engine.close()
        compiled.remove(layers)
    want = F.mse_loss(nn.Sequential(*plain)(x), y)
    want.backward()
    assert torch.allclose(loss, want.detach(), rtol=1e-6)
    for ours, theirs in zip([p for m in layers for p in m.parameters()], [p for m in plain for p in m.parameters()]):
        assert torch.allclose(ours.grad, theirs.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(not HAS_SWITCH, reason="this torch compiles backward graphs at the first backward only")
def test_the_backward_switch_is_on_for_a_variants_first_compile_only_and_off_again_after():
    """What the switch covers: a variant's first compile (until a call returned), not a later recompile of
    it (a batch of one sequence specializes a size), and the thread's setting is put back after it."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch import config

    seen = []

    def recording(gm: torch.fx.GraphModule, inputs: list) -> object:
        seen.append(config.force_non_lazy_backward_lowering)
        return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward))(gm, inputs)

    layer = nn.Linear(4, 4)
    compiled.apply([layer], compiled.compile_options({"backend": recording}), fallback=True)
    layer._roundpipe_replica = "cpu"
    try:
        for rows in (3, 5, 1):  # the first compile; the same code; a recompile for the size-1 batch
            layer(torch.randn(rows, 4)).sum().backward()
    finally:
        compiled.remove([layer])
    assert seen == [True, False]
    assert not config.force_non_lazy_backward_lowering  # off again on this thread


def test_an_error_of_running_compiled_code_gets_no_compile_note():
    """A bad token id in a compiled block is the data's fault, an out-of-memory the card's: compile=False
    would not help, so the note stays off."""
    from lightning_roundpipe.runtime.executor import raised_by_compile

    embedding = torch.compile(nn.Embedding(4, 2), backend="aot_eager", dynamic=True)
    embedding(torch.tensor([1, 2]))
    with pytest.raises(IndexError) as bad_id:
        embedding(torch.tensor([1, 9]))
    assert not raised_by_compile(bad_id.value)
    assert not raised_by_compile(torch.OutOfMemoryError("CUDA out of memory"))


class LigerLikeNorm(nn.Module):
    """Stands in for liger-kernel's RMSNorm class, as a model built after ``apply_liger_kernel_to_*`` has."""

    __module__ = "liger_kernel.transformers.rms_norm"

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


@pytest.mark.parametrize("cuda", [False, True])
def test_auto_compiles_a_hugging_face_models_blocks_on_cuda_workers_with_only_the_loss_from_liger(monkeypatch, cuda):
    """``compile="auto"`` (the default): on CUDA workers (with Triton) a preset's blocks are compiled and Liger
    binds only its fused cross-entropy (Inductor fuses the norms, SwiGLU and rotary itself); on CPU workers
    nothing is compiled. Only the choices are resolved here: nothing runs on a device."""
    from lightning_roundpipe.discovery import pipelined_layers
    from lightning_roundpipe.options import RoundPipeOptions

    monkeypatch.setattr(compiled, "auto_applies", lambda cuda, preset: cuda and preset)  # as if Triton were there
    monkeypatch.setattr(hf.kernels, "liger_installed", lambda: True)
    model = qwen3(2)
    pipelined = pipelined_layers(LMOf(model), RoundPipeOptions(), cuda=cuda)
    try:
        assert pipelined.compiled == (["Qwen3DecoderLayer x2"] if cuda else [])
        assert pipelined.kernels == (["fused linear cross-entropy x1"] if cuda else [])
        assert not any("forward" in m.__dict__ for m in model.modules() if "RMSNorm" in type(m).__name__)
    finally:
        compiled.remove(pipelined.layers)


def test_auto_leaves_eager_a_sequential_and_a_model_built_with_liger_kernels_modules(monkeypatch):
    from lightning_roundpipe.discovery import pipelined_layers
    from lightning_roundpipe.options import RoundPipeOptions

    monkeypatch.setattr(compiled, "auto_applies", lambda cuda, preset: cuda and preset)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    assert pipelined_layers(LMOf(net), RoundPipeOptions(kernels="none"), cuda=True).compiled == []
    model = qwen3(2)
    block = model.model.layers[1]
    block.post_attention_layernorm = LigerLikeNorm(block.post_attention_layernorm)
    options = RoundPipeOptions(kernels="none")
    assert compiled.foreign_kernels(hf.build_layers(model)) == ["LigerLikeNorm"]
    assert pipelined_layers(LMOf(model), options, cuda=True).compiled == []
    forced = pipelined_layers(LMOf(model), RoundPipeOptions(kernels="none", compile=True), cuda=True)
    assert forced.compiled == ["Qwen3DecoderLayer x2"]  # asked for: compiled anyway
    compiled.remove(forced.layers)


def test_auto_needs_triton_for_inductor():
    """Without Triton (this CPU wheel has none) Inductor cannot make CUDA code: ``"auto"`` stays eager."""
    from torch.utils._triton import has_triton

    assert compiled.auto_applies(cuda=True, preset=True) == has_triton()
    assert not compiled.auto_applies(cuda=False, preset=True) and not compiled.auto_applies(cuda=True, preset=False)


class LMOf(L.LightningModule):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


class Metrics(L.pytorch.loggers.Logger):
    """Keeps what is logged."""

    name, version, logged = "metrics", 0, []

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        self.logged.append(dict(metrics))

    def log_hyperparams(self, *args, **kwargs) -> None:
        pass


@pytest.mark.timeout(240)
def test_a_compiled_sequential_trains_like_plain_lightning_and_the_monitor_reports_the_compile():
    plain = fit(BoringPipeline, dict(accelerator="cpu", devices=1))
    counting, logger = Counting(), Metrics()
    strategy = RoundPipeStrategy(num_microbatches=3, async_optimizer=False, compile={"backend": counting})
    trainer_kwargs = dict(strategy=strategy, accelerator="cpu", devices=2, callbacks=[RoundPipeMonitor()])
    ours = fit(BoringPipeline, dict(trainer_kwargs, logger=logger, log_every_n_steps=1))
    assert counting.graphs >= 3  # Linear, Tanh and GELU, each its own code
    last = [m for m in logger.logged if "roundpipe/compilations" in m][-1]
    assert last["roundpipe/compilations"] >= counting.graphs and last["roundpipe/compile_s"] > 0
    assert relative_error(flat_weights(ours), flat_weights(plain)) <= 1e-5
    assert not any("forward" in m.__dict__ for m in ours.model)


# ---------------------------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("kernels", "split"), [(False, False), (True, False), (True, True)])
def test_inductor_blocks_on_a_gpu_equal_the_plain_model_and_never_wait_for_it(kernels, split):
    """The defaults (Inductor), with and without Liger's fused cross-entropy in the output stage, as the strategy
    binds it next to compiled blocks (``blocks=False``: Inductor fuses the norms, SwiGLU and rotary): the
    pipelined bf16 loss and gradients equal the plain model's to bf16 rounding, and the blocks issue no host
    sync and compile without graph breaks."""
    from test_gpu import _blocks_run_without_host_syncs

    from lightning_roundpipe.runtime.device import CudaWorkerDevice

    if kernels:
        pytest.importorskip("liger_kernel")
    model = qwen3(4)
    reference = copy.deepcopy(model).cuda()
    layers = hf.build_layers(model, split_decoder_layers=split)
    want_compiled = ["Qwen3Attention x4", "Qwen3MLP x4"] if split else ["Qwen3DecoderLayer x4"]
    assert compiled.apply(layers, compiled.compile_options(True)) == want_compiled
    if kernels:
        assert hf.kernels.apply_liger(model, layers, blocks=False) == ["fused linear cross-entropy x1"]
    engine = PipelineEngine(layers, [CudaWorkerDevice("cuda:0", 0)], plan="auto", profile_steps=1, seed=0,
                            compute_dtype=torch.bfloat16, autocast_dtype=torch.bfloat16)  # fmt: skip
    ids = torch.randint(0, 101, (4, 32), generator=torch.Generator().manual_seed(0))
    from torch._dynamo.utils import counters

    from lightning_roundpipe.runtime.compiles import compilations

    counters.clear()
    before = compilations()
    try:
        for _ in range(4):  # measuring (after the compiling batch), then the plan
            loss = engine.train_batch((ids, None, None, ids), ids, lambda out, _: out, hf.counted_tokens)
            engine.store.install_grads()
            got = torch.cat([p.grad.flatten() for p in model.parameters()])
            engine.store.clear_grads()
        assert engine.planner.fitted is not None and engine.planner._compiled_batches >= 1
        assert compilations() > before  # the blocks did run compiled
        print(f"graph breaks (kernels={kernels}, split={split}):", dict(counters["graph_break"]))
        assert not counters["graph_break"]  # transformers' block compiles whole
    finally:
        engine.close()
    with torch.autocast("cuda", torch.bfloat16):
        out = reference(input_ids=ids.cuda(), labels=ids.cuda())
    out.loss.backward()
    want = torch.cat([p.grad.float().flatten() for p in reference.parameters()]).cpu()
    assert abs(loss.item() - out.loss.item()) <= 2e-2 * abs(out.loss.item())
    assert relative_error(got, want) <= 3e-2
    cuda_layers, batch = [layer.cuda() for layer in layers], (ids.cuda(), None, None, ids.cuda())
    for module in model.modules():
        module._roundpipe_replica = "cuda:0"  # run compiled, as the workers' replicas do
    with torch.autocast("cuda", torch.bfloat16):
        out = cuda_layers[0](batch)
        for layer in cuda_layers[1:-1]:  # parameters, not a slot's tensors: another variant, compiled before the check
            out = layer((out[0].detach().requires_grad_(), *out[1:]) if layer is cuda_layers[1] else out)
        out[0].float().square().mean().backward()
        _blocks_run_without_host_syncs(cuda_layers, batch)
    compiled.remove(layers)
    if kernels:
        hf.kernels.remove(model)


@pytest.mark.gpu
def test_the_default_compiles_the_blocks_on_a_gpu_and_binds_only_liger_s_loss():
    """What ``strategy="roundpipe"`` resolves on a CUDA machine (Triton there): compiled blocks, and Liger's
    fused cross-entropy where liger-kernel is installed."""
    from lightning_roundpipe.discovery import pipelined_layers
    from lightning_roundpipe.options import RoundPipeOptions

    pipelined = pipelined_layers(LMOf(qwen3(2)), RoundPipeOptions(), cuda=True)
    try:
        assert pipelined.compiled == ["Qwen3DecoderLayer x2"]
        assert pipelined.kernels == (["fused linear cross-entropy x1"] if hf.kernels.liger_installed() else [])
    finally:
        compiled.remove(pipelined.layers)


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2", "granite"])
def test_every_dense_architectures_inductor_blocks_on_a_gpu_equal_the_model_run_directly(arch):
    """The default on a GPU for each dense family (MoE blocks stay eager): Inductor's blocks through the
    engine, fp32, a padded batch; loss and gradients equal the model run directly to float rounding."""
    from test_architectures import tiny
    from test_hf import padded_batch

    from lightning_roundpipe.runtime.compiles import compilations
    from lightning_roundpipe.runtime.device import CudaWorkerDevice

    model = tiny(arch)
    reference = copy.deepcopy(model).cuda()
    layers = hf.build_layers(model)
    assert compiled.apply(layers, compiled.compile_options("auto"))
    engine = PipelineEngine(layers, [CudaWorkerDevice("cuda:0", 0)], plan="auto", profile_steps=1, seed=0)
    batch = padded_batch()
    mask, positions = hf.plain_inputs(batch["attention_mask"], None)
    before = compilations()
    try:
        for _ in range(3):  # measuring (after the compiling batch), then the plan
            inputs = (batch["input_ids"], mask, positions, batch["labels"])
            loss = engine.train_batch(inputs, batch["labels"], lambda out, _: out, reduction=hf.counted_tokens)
            engine.store.install_grads()
            got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            engine.store.clear_grads()
        assert compilations() > before
    finally:
        engine.close()
        compiled.remove(layers)
    want = reference(**{k: v.cuda() for k, v in batch.items()})
    want.loss.backward()
    assert abs(loss.item() - want.loss.item()) <= 5e-4 * abs(want.loss.item())
    expected = {n: p.grad.cpu() for n, p in reference.named_parameters() if p.grad is not None}
    assert got.keys() == expected.keys()
    for name, grad in got.items():
        assert relative_error(grad, expected[name]) <= 5e-4, name
