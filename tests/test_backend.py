"""The torch.compile backend: ``torch.compile(model, backend="harmony", options={...})`` trains like
eager, with gradients in the model's own ``param.grad``, also across graph breaks."""
from __future__ import annotations

import copy
import dataclasses
import inspect
import warnings
from importlib.metadata import entry_points
from typing import Any, Callable

import pytest
import torch
from torch import nn

from harmony_fx.analysis.memory import eager_training_bytes
from harmony_fx.backend import harmony
from harmony_fx.models import MLPChain
from harmony_fx.testing.hf_models import HF_MODELS, build_hf_model, hf_batch
from harmony_fx.testing.models import zoo

RTOL = 1e-4
ATOL = 1e-6  # see tests/test_hf_models.py: BERT's key bias has an exactly zero gradient, i.e. noise


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles new models of the same classes: start from empty Dynamo caches, so no test
    runs into another's recompile limit."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _recording_backend(compiled: list) -> Callable:
    """``harmony``, keeping what it returns so a test can look at the harmony modules it made."""
    def backend(gm, example_inputs, **kwargs):
        compiled.append(harmony(gm, example_inputs, **kwargs))
        return compiled[-1]
    return backend


def _train_like_eager(model: nn.Module, loss_of: Callable[[Any], torch.Tensor], options: dict,
                      backend: Any = "harmony") -> nn.Module:
    """Three SGD steps through torch.compile next to three on an eager copy: losses and every
    gradient equal. Returns the eager copy."""
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend=backend, dynamic=True, options=options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        loss = loss_of(compiled)
        expected = loss_of(reference)
        torch.testing.assert_close(loss, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"step {step}, loss: {m}")
        loss.backward()
        expected.backward()
        for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
            assert param.grad is not None, f"step {step}: no gradient in {name}.grad"
            torch.testing.assert_close(param.grad, ref.grad, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"step {step}, grad of {name}: {m}")
        optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    return reference


def test_backend_is_registered_through_the_entry_point():
    (entry,) = [e for e in entry_points(group="torch_dynamo_backends") if e.name == "harmony"]
    assert entry.value == "harmony_fx.backend:harmony"
    assert "harmony" in torch._dynamo.list_backends()
    assert torch._dynamo.lookup_backend("harmony") is harmony


def test_zoo_mlp_trains_like_eager_at_a_quarter_of_the_memory(memory_witness):
    entry = zoo()["mlp_chain"]
    model, (x,), target = entry.build(0)
    budget = eager_training_bytes(model, (x,), lambda out: entry.loss_fn(out, target)) // 4
    compiled: list = []
    _train_like_eager(model, lambda m: entry.loss_fn(m(x), target), {"memory_budget": budget, "microbatches": 2},
                      _recording_backend(compiled))
    (hm,) = [hm for program in compiled for hm in program.harmony_modules]
    assert hm.budget == budget and hm.num_microbatches == 2 and len(hm.packs) > 1
    assert memory_witness.peak_of(hm.devices[0]) == hm.stats.peak_bytes[hm.devices[0].name] <= budget


# GPT-2 through the backend also trains padded batches in tests/test_hf_models.py: slow here (the suite under 8 minutes)
@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n == "gpt2" else []) for n in HF_MODELS])
def test_hf_model_trains_like_eager_at_a_quarter_of_the_memory(name):
    pytest.importorskip("transformers")
    model = build_hf_model(name)
    batch = hf_batch(name)
    budget = eager_training_bytes(model, (), lambda out: out.loss, batch) // 4
    _train_like_eager(model, lambda m: m(**batch).loss, {"memory_budget": budget, "microbatches": 4})


class BrokenMLP(nn.Module):
    """An MLP whose forward Dynamo cannot trace in one piece."""

    def __init__(self) -> None:
        super().__init__()
        self.first = MLPChain(width=32, depth=4, num_classes=32)
        self.second = MLPChain(width=32, depth=4, num_classes=10)

    def forward(self, x):
        h = self.first(x)
        torch._dynamo.graph_break()
        return self.second(torch.tanh(h))


def test_graph_breaks_make_programs_that_train_together_like_eager():
    torch.manual_seed(0)
    model = BrokenMLP()
    x, target = torch.randn(16, 32), torch.randint(0, 10, (16,))
    budget = eager_training_bytes(model, (x,), lambda out: nn.functional.cross_entropy(out, target)) // 2
    compiled: list = []
    _train_like_eager(model, lambda m: nn.functional.cross_entropy(m(x), target),
                      {"memory_budget": budget, "microbatches": 2}, _recording_backend(compiled))
    modules = [hm for program in compiled for hm in program.harmony_modules]
    assert len(modules) >= 2
    # the second graph's input is the first's output: its gradient goes back through autograd
    assert any(hm.signature.inputs_requiring_grad for hm in modules)


class _CumulativeBatchNormBlock(nn.Module):
    """``BatchNorm(momentum=None)`` breaks Dynamo's graph inside it (``float(num_batches_tracked)``);
    its output is then a value on Dynamo's stack, which ``ReLU(inplace=True)`` writes in place."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=None)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.relu(self.bn(self.conv(x))) + x


def test_a_value_on_dynamos_stack_written_in_place_trains_like_eager():
    """It was refused as an input modified in place, advising to clone ``___stack0``, which no code of
    the user's holds; the graph now writes a copy of it. Running statistics as eager's too."""
    torch.manual_seed(0)
    model = nn.Sequential(_CumulativeBatchNormBlock(), _CumulativeBatchNormBlock(), nn.Flatten(), nn.Linear(256, 3))
    x = torch.randn(4, 4, 8, 8)
    reference = _train_like_eager(model, lambda m: m(x).square().mean(), {"devices": ["host:0"]})
    for (name, buffer), expected in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(buffer, expected, rtol=RTOL, atol=ATOL, msg=name)


class CachedMaskTransformer(nn.Module):
    """PyTorch's word_language_model TransformerModel, small: the causal mask is kept on the module
    and made again when the length changes (Dynamo recompiles once the attribute is set)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(8, 20)
        self.src_mask = None

    def forward(self, src: torch.Tensor) -> torch.Tensor:
        if self.src_mask is None or self.src_mask.size(0) != len(src):
            self.src_mask = nn.Transformer.generate_square_subsequent_mask(len(src))
        return self.head(self.encoder(self.embed(src), mask=self.src_mask))


def test_batches_sliced_from_one_tensor_run_whatever_their_storage_offset():
    """word_language_model's get_batch (source[i:i + bptt]): each batch a view at another offset,
    which Dynamo passes as a graph input the graph never reads; it was baked in and the third batch
    refused."""
    torch.manual_seed(0)
    model = CachedMaskTransformer()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="harmony", dynamic=True, options={"devices": ["host:0"]})
    source = torch.randint(0, 20, (60, 4))
    for start in range(0, 50, 10):
        batch = source[start:start + 10]
        torch.testing.assert_close(compiled(batch), reference(batch), rtol=RTOL, atol=ATOL)


@dataclasses.dataclass
class _Batch:
    x: torch.Tensor


@dataclasses.dataclass
class _Hidden:
    hidden: torch.Tensor


class FieldsAcrossABreak(nn.Module):
    """Its input is a dataclass's field, and what crosses its graph break is another's (as a
    ``ModelOutput``'s ``last_hidden_state`` does in a Hugging Face model): Dynamo reaches both
    through an attribute of a local, and both are activations, whose gradients flow."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 16), nn.Linear(16, 4)

    def body(self, batch: _Batch) -> _Hidden:
        return _Hidden(torch.relu(self.first(batch.x)))

    def forward(self, batch: _Batch) -> torch.Tensor:
        out = self.body(batch)
        torch._dynamo.graph_break()
        return self.second(out.hidden)


def test_an_activation_reached_through_a_field_is_differentiated_not_kept_as_state():
    """Before, a tensor reached through any attribute was taken for a buffer: the first linear got
    no gradient, and the next call's new activation was refused as "replaced after torch.compile"."""
    torch.manual_seed(0)
    model = FieldsAcrossABreak()
    # a new batch each step (the compiled call, then the eager one, read the same)
    batches = iter([batch for batch in (_Batch(torch.randn(8, 8)) for _ in range(3)) for _twice in range(2)])
    _train_like_eager(model, lambda m: m(next(batches)).square().mean(), {"microbatches": 2})


def test_another_instance_of_the_class_runs_on_its_own_weights():
    """Dynamo runs the graph it made for the first instance for every instance of the class (a
    model loaded from a checkpoint, as word_language_model evaluates its best one); the program is
    compiled again around the new instance's tensors (it was refused), and again after weights
    are replaced in place of the old ones (``load_state_dict(assign=True)``)."""
    torch.manual_seed(0)
    first, second = MLPChain(width=8, depth=2), MLPChain(width=8, depth=2)
    x = torch.randn(4, 8)
    torch.compile(first, backend="harmony", dynamic=True)(x).sum().backward()
    for step in range(2):
        reference = copy.deepcopy(second)
        out = torch.compile(second, backend="harmony", dynamic=True)(x)
        expected = reference(x)
        torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)
        out.sum().backward()
        expected.sum().backward()
        for param, ref in zip(second.parameters(), reference.parameters()):
            torch.testing.assert_close(param.grad, ref.grad, rtol=RTOL, atol=ATOL)
        second.load_state_dict({name: torch.randn_like(value) for name, value in second.state_dict().items()},
                               assign=True)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.linear(x))


class _LoggedBlocks(nn.Module):
    """A graph break in each block (activation logging with .item(), as a monitoring hook does):
    Dynamo compiles the block's forward once and runs it for every block, each with its own
    weights; harmony compiled again at every block of every step (50-80x slower)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.seen: list[float] = []

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
            self.seen.append(x.abs().max().item())
        return x


def test_a_graph_run_for_more_states_than_it_keeps_lets_the_oldest_go_and_says_so(monkeypatch):
    """Each program holds its state's tensors (weights loaded again and again with assign=True would
    stay alive): past the bound the least recently used go, and the results stay eager's."""
    from harmony_fx import backend

    monkeypatch.setattr(backend, "_PROGRAMS_KEPT", 1)
    torch.manual_seed(0)
    model = _LoggedBlocks()
    reference = copy.deepcopy(model)
    compiled: list = []
    x = torch.randn(4, 8)
    with pytest.warns(UserWarning, match="more states .* than the 1 programs"):
        out = torch.compile(model, backend=_recording_backend(compiled))(x)
    torch.testing.assert_close(out, reference(x), rtol=RTOL, atol=ATOL)
    assert max(len(program.modules) for program in compiled) == 1
    assert sum(program.states_dropped for program in compiled) >= 1


def _harmony_compiles(monkeypatch) -> list:
    """A list that gets an item at every harmony compile (a call state planned), from now on."""
    from harmony_fx import api

    compiles: list = []
    original = api.HarmonyModule._compile

    def counted(self, *args, **kwargs):
        compiles.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(api.HarmonyModule, "_compile", counted)
    return compiles


def test_a_graph_dynamo_runs_for_every_layer_keeps_a_program_per_layer(monkeypatch):
    compiles = _harmony_compiles(monkeypatch)
    torch.manual_seed(0)
    model = _LoggedBlocks()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="harmony")
    x = torch.randn(4, 8)
    for step in range(3):
        out, expected = compiled(x), reference(x)
        torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)
        out.sum().backward()
        expected.sum().backward()
        if step == 0:
            first = len(compiles)
    assert len(compiles) == first  # the later steps compiled nothing
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad, rtol=RTOL, atol=ATOL)


def test_dynamos_last_compile_of_a_function_warns_that_later_states_run_outside_harmony():
    """Past the recompile limit Dynamo runs the function eagerly, never asking the backend: the
    memory budget no longer holds, which only Dynamo's log said, without naming harmony."""
    torch.manual_seed(0)
    compiled = torch.compile(MLPChain(width=8, depth=2), backend="harmony", dynamic=False)
    warned = pytest.warns(UserWarning, match="compiled this function 2 times, its limit.*dynamic=True")
    with torch._dynamo.config.patch(recompile_limit=2), warned:
        for batch in (2, 3):
            compiled(torch.randn(batch, 8))


class _Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(8, 16), nn.Linear(16, 4)
        self.middle = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
        self.reentrant = reentrant

    def forward(self, x):
        hidden = torch.utils.checkpoint.checkpoint(self.middle, torch.tanh(self.first(x)), use_reentrant=self.reentrant)
        return self.last(torch.tanh(hidden))


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpointed_region_runs_as_it_is(reentrant):
    """Dynamo keeps torch.utils.checkpoint's region as one op, which export refused
    ("_checkpoint_context_fn"); harmony recomputes each pack itself, so the region just runs."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    _train_like_eager(_Checkpointed(reentrant), lambda m: m(x).square().mean(), {"devices": ["host:0"]})


def test_a_graph_that_computes_nothing_is_passed_through():
    """Dynamo's graph between two breaks may only hand values on (pack_padded_sequence around an
    LSTM with allow_rnn): it was refused as "computes nothing"; it runs as it is."""
    graph = torch.fx.Graph()
    x, lengths = graph.placeholder("x"), graph.placeholder("lengths")
    graph.output((x, lengths))
    gm = torch.fx.GraphModule(nn.Module(), graph)
    inputs = (torch.randn(4, 6), torch.tensor([6, 3, 5, 2]))
    compiled = harmony(gm, inputs)
    assert all(out is given for out, given in zip(compiled(*inputs), inputs))


@pytest.mark.parametrize("suppress_errors", [False, True])
def test_static_batch_with_microbatches_asks_for_dynamic_shapes(suppress_errors):
    """Raised when the graph is called: with Dynamo's suppress_errors a backend's error at compile is
    swallowed, and the function ran eagerly, outside harmony and its budget, with only a log line."""
    torch.manual_seed(0)
    compiled = torch.compile(MLPChain(width=8, depth=2), backend="harmony", options={"microbatches": 2})
    with torch._dynamo.config.patch(suppress_errors=suppress_errors), pytest.raises(Exception, match="dynamic=True"):
        compiled(torch.randn(4, 8))


class _WritesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, features):
        features.mul_(2)
        return self.linear(features)


def test_messages_and_graphs_name_the_inputs_as_the_users_code_does():
    """Dynamo's graph calls the input ``l_features_``; harmony's graph and its refusals say
    ``features``, as the model's code does (not ``inputs_0``)."""
    with pytest.raises(ValueError, match=r"modifies its input 'features' in place.*features = features \+ 1"):
        torch.compile(_WritesItsInput(), backend="harmony", dynamic=True)(torch.randn(4, 4))
    model = MLPChain(width=8, depth=2)
    compiled = torch.compile(model, backend="harmony", options={"microbatches": 2})
    parameter = next(iter(inspect.signature(model.forward).parameters))
    with pytest.raises(ValueError, match=f"its input {parameter} has the fixed shape"):
        compiled(torch.randn(4, 8))
    made: list = []
    torch.compile(model, backend=_recording_backend(made), dynamic=True)(torch.randn(4, 8))
    (hm,) = made[0].harmony_modules
    assert f"'act[{parameter}@0]'" in hm.code  # the user's name; Dynamo's is l_{parameter}_


def test_a_batch_of_one_dynamo_fixed_runs_as_one_microbatch():
    """dynamic=True still fixes a size of 1 (Dynamo specializes it): a loader's last batch of one
    sample runs as one microbatch instead of being refused as a static batch."""
    torch.manual_seed(0)
    model = MLPChain(width=8, depth=2)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="harmony", dynamic=True, options={"microbatches": 2})
    for batch in (4, 1):
        x = torch.randn(batch, 8)
        compiled(x).square().sum().backward()
        reference(x).square().sum().backward()
        for param, expected in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(param.grad, expected.grad, rtol=RTOL, atol=ATOL)
            param.grad = expected.grad = None


def test_unknown_option_is_refused_with_the_known_ones():
    compiled = torch.compile(MLPChain(width=8, depth=2), backend="harmony", options={"budget": "1MiB"})
    with pytest.raises(Exception, match="memory_budget"):
        compiled(torch.randn(4, 8))


def test_without_microbatches_a_static_graph_trains_like_eager():
    torch.manual_seed(0)
    model = MLPChain(width=16, depth=4)
    x, target = torch.randn(8, 16), torch.randint(0, 10, (8,))
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="harmony", options={"memory_budget": "1MiB"})
    nn.functional.cross_entropy(compiled(x), target).backward()
    nn.functional.cross_entropy(reference(x), target).backward()
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad, rtol=RTOL, atol=ATOL)


def test_options_come_from_the_environment_where_the_code_passes_none(monkeypatch):
    """A script that only says backend="harmony" runs under the budget HARMONY_FX_MEMORY_BUDGET
    sets; an option the code passes wins over its variable."""
    monkeypatch.setenv("HARMONY_FX_MEMORY_BUDGET", "3MiB")
    monkeypatch.setenv("HARMONY_FX_MICROBATCHES", "4")
    torch.manual_seed(0)
    model = MLPChain(width=16, depth=4)
    compiled: list = []
    x = torch.randn(8, 16)
    torch.compile(model, backend=_recording_backend(compiled), dynamic=True, options={"microbatches": 2})(x)
    (hm,) = compiled[0].harmony_modules
    assert hm.options.memory_budget == 3 * 2**20
    assert hm.num_microbatches == 2


def test_the_trainers_environment_variables_are_not_refused_by_the_backend(monkeypatch, tmp_path):
    """HARMONY_FX_NVME_PATH and HARMONY_FX_HOST_MEMORY size the Trainer's host state (HarmonyTrainer,
    HarmonyStrategy): a torch.compile in the same script runs without them, where it refused them
    as options it was never passed."""
    monkeypatch.setenv("HARMONY_FX_NVME_PATH", str(tmp_path))
    monkeypatch.setenv("HARMONY_FX_HOST_MEMORY", "1GiB")
    torch.manual_seed(0)
    model = MLPChain(width=16, depth=4)
    reference = copy.deepcopy(model)
    x = torch.randn(8, 16)
    torch.compile(model, backend="harmony")(x).sum().backward()
    reference(x).sum().backward()
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad, rtol=RTOL, atol=ATOL)


def test_a_refused_budget_is_remembered_for_the_same_graph_and_shapes(monkeypatch):
    """Dynamo calls the compiled frame again on every call: a budget no packing fits is refused
    once by planning and after that from memory, the same error; another shape is planned anew."""
    import harmony_fx.backend as backend
    from harmony_fx import BudgetTooSmallError

    compiles = []

    def counting_compile(*args, **kwargs):
        compiles.append(args[1][0].shape)
        return harmony_compile(*args, **kwargs)

    harmony_compile = backend.harmony_compile
    monkeypatch.setattr(backend, "harmony_compile", counting_compile)
    torch.manual_seed(0)
    compiled = torch.compile(MLPChain(width=16, depth=4), backend="harmony",
                             options={"memory_budget": 1000, "devices": ["host:0"]})
    x = torch.randn(8, 16)
    refusals = []
    for _ in range(3):
        with pytest.raises(BudgetTooSmallError) as info:
            compiled(x)
        refusals.append(info.value)
    assert compiles == [x.shape]
    assert all(r.smallest_budget == refusals[0].smallest_budget > 1000 for r in refusals)
    notes = "\n".join(getattr(refusals[-1], "__notes__", []))
    assert "remembered" in notes and "one graph Dynamo made of the model" in notes  # its breaks planned apart
    with pytest.raises(BudgetTooSmallError):
        compiled(torch.randn(4, 16))  # another shape: Dynamo's graph is new or dynamic, planned again
    assert len(compiles) == 2


def test_a_remembered_refusal_keeps_no_call_and_its_inputs_alive():
    """The refusal kept for a graph's shapes holds no traceback: a loop that catches the refusal and
    drops the batch gets the batch's memory back, as eager would."""
    import gc
    import weakref

    from harmony_fx import BudgetTooSmallError

    torch.manual_seed(0)
    compiled = torch.compile(MLPChain(width=16, depth=4), backend="harmony",
                             options={"memory_budget": 1000, "devices": ["host:0"]})
    inputs = []
    for _ in range(2):  # planned, then from memory
        x = torch.randn(8, 16)
        inputs.append(weakref.ref(x))
        with pytest.raises(BudgetTooSmallError) as info:
            compiled(x)
        assert info.value.smallest_budget > 1000
        del x, info
    gc.collect()
    assert [ref() for ref in inputs] == [None, None]


class _FlattensPerSample(nn.Module):
    """``x.view(x.shape[0], -1)``: Dynamo's static graph bakes the batch size into the view."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 16), nn.Linear(32, 2)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)).view(x.shape[0], -1))


def test_a_static_graph_runs_whole_and_its_refusal_says_dynamic_shapes_may_cut_it():
    """The planner tried one sample per microbatch on Dynamo's fixed-size graph, whose capture then
    failed on the baked view; the refusal listed that CaptureError as "also tried"."""
    from harmony_fx import BudgetTooSmallError

    torch.manual_seed(0)
    model = _FlattensPerSample()
    x = torch.randn(8, 2, 8)
    compiled = torch.compile(model, backend="harmony", options={"memory_budget": 1, "devices": ["host:0"]})
    with pytest.raises(BudgetTooSmallError) as info:
        compiled(x)
    assert "also tried" not in str(info.value)
    assert "dynamic=True" in "\n".join(info.value.__notes__)
    torch._dynamo.reset()
    smallest = info.value.smallest_budget
    compiled = torch.compile(model, backend="harmony", options={"memory_budget": smallest, "devices": ["host:0"]})
    torch.testing.assert_close(compiled(x), model(x), rtol=RTOL, atol=ATOL)


class _CastsToDouble(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.first(x)).double()
        return self.second(h.to(x.dtype))


def test_bf16_trains_a_graph_dynamo_left_in_the_input_dtype_like_the_model_in_bf16():
    torch.manual_seed(0)
    model = MLPChain(width=16, depth=4)
    reference = copy.deepcopy(model).to(torch.bfloat16)
    compiled = torch.compile(model, backend="harmony", options={"precision": "bf16", "devices": ["host:0"]})
    x = torch.randn(8, 16)
    out, expected = compiled(x), reference(x.to(torch.bfloat16))
    assert out.dtype == torch.float32 and torch.equal(out, expected.float())
    out.sum().backward()
    expected.float().sum().backward()
    for param, ref in zip(model.parameters(), reference.parameters()):
        assert torch.equal(param.grad, ref.grad.float())


def test_bf16_refuses_a_graph_in_which_dynamo_baked_a_wider_float_naming_the_line(monkeypatch):
    """Dynamo bakes ``h.to(x.dtype)`` as a cast to the fp32 it saw: under bf16 that value would meet
    bf16 weights. Refused naming the model's line and what to do, once: remembered after."""
    import harmony_fx.backend as backend

    compiles = []
    harmony_compile = backend.harmony_compile
    monkeypatch.setattr(backend, "harmony_compile", lambda *a, **k: compiles.append(1) or harmony_compile(*a, **k))
    compiled = torch.compile(_CastsToDouble(), backend="harmony", options={"precision": "bf16", "devices": ["host:0"]})
    for _ in range(2):
        with pytest.raises(ValueError) as info:
            compiled(torch.randn(4, 8))
        message = str(info.value)
        # the cast Dynamo baked (to the float32 it saw), the capture's refusal of what it meets
        assert "torch.float32" in message and "`return self.second(h.to(x.dtype))`" in message, message
        assert "harmony_fx.compile(model, ..., precision='bf16')" in message
    assert compiles == [1]


def test_bf16_refuses_a_graph_whose_capture_meets_a_float32_value_dynamo_made():
    """GPT-2 with its key/value cache on: Dynamo's graph makes the cache in float32, which the
    capture at bf16 met as a dtype mismatch inside attention; the error advised about control flow."""
    pytest.importorskip("transformers")
    model = build_hf_model("gpt2")
    model.config.use_cache = True
    batch = hf_batch("gpt2")
    compiled = torch.compile(model, backend="harmony", options={"precision": "bf16", "devices": ["host:0"]})
    with pytest.raises(ValueError, match=r"in torch.float32 \(the model's `.*dtype.*`\).*precision='bf16'"):
        compiled(**batch)


class _ReversesGradients(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        return -3 * grad


def test_an_autograd_function_dynamo_kept_whole_keeps_its_own_backward():
    """Dynamo hands over a model's autograd Function as ``autograd_function_apply`` (its forward
    and backward as subgraphs); export alone traced the forward under no_grad, and nothing before
    it got a gradient. Its own backward now runs: every gradient eager's."""
    torch.manual_seed(0)
    first, second = nn.Linear(8, 8), nn.Linear(8, 4)
    model = nn.Sequential(first, nn.Tanh(), _ApplyingFunction(), second)
    reference = copy.deepcopy(model)
    x = torch.randn(8, 8)
    compiled = torch.compile(model, backend="harmony", options={"memory_budget": "1MiB"})
    compiled(x).square().mean().backward()
    reference(x).square().mean().backward()
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad, ref.grad, rtol=RTOL, atol=ATOL, msg=name)


class _ApplyingFunction(nn.Module):
    def forward(self, x):
        return _ReversesGradients.apply(x)


class _SavesItsInput(torch.autograd.Function):
    """BLOOM's GeLUFunction: saves its input, computes its own gradient from it."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.tanh(x) * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (torch.tanh(x) + x * (1 - torch.tanh(x) ** 2))


class _TwoFunctions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = nn.Linear(16, 64), nn.Linear(64, 16), nn.Linear(16, 64), nn.Linear(64, 4)

    def forward(self, x):
        return self.d(_SavesItsInput.apply(self.c(self.b(_SavesItsInput.apply(self.a(x))))))


def test_an_autograd_functions_saved_values_leave_the_device_with_its_backward():
    """Torch's autograd_function_apply makes a Function class per call whose backward closes over
    the saved values: they (the pack's weights on the device, the saved input) stayed counted on
    the device after the backward until the garbage collector ran, and a tiny BLOOM passed its
    budget at the second step. Applied with ctx.save_for_backward, the device is empty after each
    backward, and every gradient is eager's."""
    import gc

    torch.manual_seed(0)
    model = _TwoFunctions()
    reference = copy.deepcopy(model)
    x = torch.randn(32, 16)
    compiled: list = []
    run = torch.compile(model, backend=_recording_backend(compiled), options={
        "devices": ["host:0"], "track_memory": True, "microbatches": 1, "pack_boundaries": [0, 3]})
    gc_was = gc.isenabled()
    gc.disable()  # what is left for the collector is what a step leaks until it runs
    try:
        for _ in range(2):
            run(x).square().mean().backward()
            reference(x).square().mean().backward()
            (hm,) = [hm for program in compiled for hm in program.harmony_modules]
            assert len(hm.packs) == 2 and hm.devices[0].live_bytes() == 0
    finally:
        if gc_was:
            gc.enable()
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad, rtol=RTOL, atol=ATOL, msg=name)


def test_a_whole_training_step_compiled_trains_like_eager():
    """forward, backward and optimizer.step under one torch.compile (PyTorch's pattern): Dynamo hands
    over the optimizer's graph too, which writes the parameters in place; harmony took it for a
    model to train and failed to capture it. It runs as it is, on the host parameters."""
    torch.manual_seed(0)
    model = MLPChain(width=8, depth=2)
    reference = copy.deepcopy(model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference)]
    x, y = torch.randn(8, 8), torch.randint(0, 8, (8,))

    def step(m, optimizer):
        loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    compiled = torch.compile(lambda: step(model, optimizers[0]), backend="harmony", options={"devices": ["host:0"]})
    for _ in range(3):
        torch.testing.assert_close(compiled(), step(reference, optimizers[1]), rtol=RTOL, atol=ATOL)
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param, ref, rtol=RTOL, atol=ATOL)


class _Tempered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x, temperature):
        return torch.log_softmax(self.last(torch.relu(self.first(x))) / temperature, -1)


def test_a_number_dynamo_stops_specializing_is_an_input_not_a_new_program_each_value(monkeypatch):
    """A temperature annealed every step: Dynamo passes it as a 0-dim tensor so that a new value
    compiles nothing, and harmony baked it in and planned a program for every value (57x slower)."""
    compiles = _harmony_compiles(monkeypatch)
    torch.manual_seed(0)
    model = _Tempered()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="harmony", options={"devices": ["host:0"]})
    x = torch.randn(4, 8)
    for step in range(6):
        temperature = 1.0 - 0.1 * step
        out, expected = compiled(x, temperature), reference(x, temperature)
        torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)
        out.sum().backward()
        expected.sum().backward()
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad, rtol=RTOL, atol=ATOL)
    assert len(compiles) <= 2  # the first value's graph, then the one for every value


def test_a_graph_compiled_for_many_input_shapes_says_to_pad():
    """dynamic=True spares Dynamo's recompiles, but each new sequence length is a harmony program
    of its own: nothing said so (harmony_fx.compile warns at its ninth)."""
    from harmony_fx.api import MANY_VARIANTS

    torch.manual_seed(0)
    compiled = torch.compile(_Tempered(), backend="harmony", dynamic=True, options={"devices": ["host:0"]})
    with pytest.warns(UserWarning, match=rf"compiled for {MANY_VARIANTS + 1} input shapes.*pad_to_multiple_of"):
        for length in range(1, MANY_VARIANTS + 3):
            compiled(torch.randn(2, length, 8), 1.0)


class _Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1  # Dynamo returns the update, to set the attribute again
        return self.linear(x)


def test_a_buffer_updated_in_the_forward_is_returned_as_the_buffer_under_torch_compile():
    """Dynamo's graph returns the in-place update of the counter: with microbatches it was refused as
    an output that does not depend on the batch (naming an output 'add_' the model does not have);
    it is the buffer, and the cut warns as harmony_fx.compile's does."""
    import harmony_fx

    torch.manual_seed(0)
    model, reference = _Counting(), _Counting()
    reference.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="harmony", options={"devices": ["host:0"]})
    x = torch.randn(8, 8)
    for _ in range(3):
        torch.testing.assert_close(compiled(x), reference(x), rtol=RTOL, atol=ATOL)
    assert int(model.calls) == int(reference.calls) == 3
    torch._dynamo.reset()
    cut = torch.compile(_Counting(), backend="harmony", dynamic=True,
                        options={"devices": ["host:0"], "microbatches": 2})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cut(x).sum().backward()  # runs (it was refused)
    # where Dynamo keeps the update in the forward's graph (torch 2.13; 2.11 splits it off), the cut warns
    said = [str(w.message) for w in caught if issubclass(w.category, harmony_fx.MicrobatchesComputeApart)]
    assert all("updates a buffer in place" in message for message in said)


def test_an_input_changed_in_place_before_the_backward_is_refused_through_torch_compile():
    torch.manual_seed(0)
    model = MLPChain(width=8, depth=4)
    compiled = torch.compile(model, backend="harmony", dynamic=True, options={"pack_boundaries": [0, 2]})
    x = torch.randn(4, 8)
    out = compiled(x)
    x.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an in-place operation after the forward"):
        out.square().mean().backward()


def test_run_from_a_checkout_without_an_install_the_backend_is_registered_on_import(monkeypatch):
    """``PYTHONPATH=.`` has no entry point: ``backend="harmony"`` was unknown to Dynamo even after
    ``import harmony_fx``."""
    import importlib.metadata

    from torch._dynamo.backends import registry

    import harmony_fx

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **_: [])
    monkeypatch.setattr(registry, "_COMPILER_FNS", {k: v for k, v in registry._COMPILER_FNS.items() if k != "harmony"})
    monkeypatch.setattr(registry, "_BACKENDS", {k: v for k, v in registry._BACKENDS.items() if k != "harmony"})
    harmony_fx._register_the_backend_without_an_install()
    assert registry.lookup_backend("harmony") is harmony
