"""capture: model → GraphModule with meta["val"] everywhere, parameters mapped to the model's own."""
from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import harmony_fx
from harmony_fx.frontend.capture import CaptureError, capture
from harmony_fx.ir import meta
from harmony_fx.models import TinyGPT
from tests.helpers import ZOO, assert_grads_equal, assert_step_equal, smallest_budget, train_step


@pytest.fixture(scope="module")
def captured_zoo():
    result = {}
    for name, entry in ZOO.items():
        model, inputs, _ = entry.build(0)
        result[name] = (model, inputs, capture(model, inputs))
    return result


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_models_capture_with_torch_export(captured_zoo, name):
    model, inputs, captured = captured_zoo[name]
    assert captured.method == "torch.export"
    captured.gm.graph.lint()
    missing = [node.name for node in captured.gm.graph.nodes if node.op != "output" and meta.VAL not in node.meta]
    assert not missing, f"nodes without meta['val']: {missing}"


@pytest.mark.parametrize("name", list(ZOO))
def test_placeholders_have_roles_and_map_to_the_models_own_tensors(captured_zoo, name):
    model, inputs, captured = captured_zoo[name]
    model_params = {id(p) for p in model.parameters()}
    model_buffers = {id(b) for b in model.buffers()}
    assert {id(p) for p in captured.params.values()} == model_params
    assert {id(b) for b in captured.buffers.values()} == model_buffers
    roles = {node.name: meta.role_of(node) for node in captured.gm.graph.find_nodes(op="placeholder")}
    assert all(roles[name] == meta.Role.PARAM for name in captured.params)
    assert all(roles[name] == meta.Role.BUFFER for name in captured.buffers)
    assert [n for n, role in roles.items() if role == meta.Role.INPUT] == captured.inputs
    assert len(captured.inputs) == len(inputs)
    placeholders = {node.name: node for node in captured.gm.graph.find_nodes(op="placeholder")}
    for name, value in zip(captured.inputs, inputs):
        fake = placeholders[name].meta[meta.VAL]
        assert tuple(fake.shape) == tuple(value.shape) and fake.dtype == value.dtype


def test_tied_weights_are_one_parameter_object(captured_zoo):
    model, _, captured = captured_zoo["tiny_gpt"]
    assert isinstance(model, TinyGPT) and model.lm_head.weight is model.wte.weight
    targets = {node.meta[meta.TARGET]: captured.params[node.name]
               for node in captured.gm.graph.find_nodes(op="placeholder") if node.name in captured.params}
    tied = [param for target, param in targets.items() if target in ("wte.weight", "lm_head.weight")]
    assert tied, f"no placeholder for the tied embedding among {sorted(targets)}"
    assert all(param is model.wte.weight for param in tied)
    # every distinct model parameter appears once by identity, however many names it has
    assert len({id(p) for p in captured.params.values()}) == len(list(model.parameters()))


class KeywordModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.gate = nn.Linear(6, 6)

    def forward(self, x, *, y):
        return self.proj(x) * torch.sigmoid(self.gate(y))


def test_keyword_inputs():
    torch.manual_seed(0)
    model, reference = KeywordModel(), KeywordModel()
    reference.load_state_dict(model.state_dict())
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    hm = harmony_fx.compile(model, (), {"x": x, "y": y})
    assert hm.captured.inputs and len(hm.captured.inputs) == 2
    # keyword order does not matter
    out = hm(y=y, x=x)
    expected = reference(x, y=y)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-7)
    out.square().sum().backward()
    expected.square().sum().backward()
    assert_grads_equal(model, reference)


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # Python control flow on a tensor's value
            return self.linear(x)
        return -self.linear(x)


def test_data_dependent_control_flow_is_refused_with_advice():
    with pytest.raises(harmony_fx.CaptureError) as info:
        harmony_fx.compile(DataDependent(), (torch.randn(2, 4),))
    message = str(info.value)
    assert "torch.export" in message
    assert "symbolic_trace" in message
    assert "DataDependent" in message
    assert "torch.where" in message and "torch.cond" not in message  # what to do instead (harmony refuses cond)
    assert "test_capture.py:" in message and "in forward: if x.sum() > 0:" in message  # the model's line
    assert isinstance(info.value, ValueError) and harmony_fx.CaptureError is CaptureError


class _VarlenSplit(nn.Module):
    """Qwen2-VL's vision attention: each image's patches attended apart, split by sizes read from a
    tensor whose length is itself data-dependent (``repeat_interleave`` of the grid), in a list
    comprehension."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, grid_thw):
        lengths = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
        h = self.proj(x)
        parts = [torch.split(t, lengths.tolist(), dim=0) for t in (h, h * 2)]
        return sum(torch.cat([p.softmax(0) for p in pieces]).sum() for pieces in parts)


def test_a_refusal_names_the_models_line_in_a_comprehension():
    """Export names the frame it stopped in as ``in <listcomp>``: the refusal names that line of the
    model (it named only torch's ``unbind``, with advice about a loss)."""
    with pytest.raises(harmony_fx.CaptureError) as info:
        harmony_fx.compile(_VarlenSplit(), (torch.randn(8, 8), torch.tensor([[1, 2, 2], [1, 2, 2]])),
                           devices=["host:0"], microbatches=1)
    assert "test_capture.py:" in str(info.value) and "torch.split(t, lengths.tolist(), dim=0)" in str(info.value)


class _AnyResolution(nn.Module):
    """LLaVA-NeXT's anyres: a scale from sizes read out of ``image_sizes``, taken with Python's ``min``
    (which export's own machinery evaluates, so its message names no frame of the model)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, image_sizes):
        height, width = image_sizes[0].tolist()
        scale = min(28 / width, 28 / height)
        return self.proj(x).sum() * 2 if scale > 1 else self.proj(x).sum()


def test_a_refusal_names_the_models_line_where_exports_message_names_none():
    """The model's line comes from the error's own traceback where export's message names none (the
    refusal said only what to try in general, and about a loss)."""
    with pytest.raises(harmony_fx.CaptureError) as info:
        harmony_fx.compile(_AnyResolution(), (torch.randn(2, 8), torch.tensor([[28, 14], [28, 14]])),
                           devices=["host:0"], microbatches=1)
    assert "test_capture.py:" in str(info.value) and "scale = min(28 / width, 28 / height)" in str(info.value)


class _SampledLatent(nn.Module):
    """A VAE's ``latent_dist.sample(generator=g)``: the noise drawn from a generator passed in, or
    made in the forward."""

    def __init__(self, seed: int | None = None) -> None:
        super().__init__()
        self.enc, self.seed = nn.Linear(4, 8), seed

    def forward(self, x, generator=None):
        if self.seed is not None:
            generator = torch.Generator().manual_seed(self.seed)
        mean, logvar = self.enc(x).chunk(2, dim=-1)
        return mean + (0.5 * logvar).exp() * torch.randn(mean.shape, generator=generator)


@pytest.mark.parametrize("seed", [None, 3], ids=["passed-in", "made-in-forward"])
def test_a_generator_in_the_forward_is_refused_naming_it(seed):
    """The advice was about control flow and caches."""
    kwargs = {"generator": torch.Generator().manual_seed(0)} if seed is None else {}
    with pytest.raises(harmony_fx.CaptureError, match=r"What to try: the forward uses a torch.Generator.*"
                                                       r"torch.manual_seed.*pass it in as a tensor"):
        harmony_fx.compile(_SampledLatent(seed), (torch.randn(4, 4),), example_kwargs=kwargs, devices=["host:0"])


def test_inputs_the_model_itself_raises_on_are_named_not_taken_for_a_tracing_problem():
    """Three features into a linear of four raise eagerly too (as float token ids into an embedding
    do, where torch's meta kernels check the dtype: 2.13, not 2.11); the message was advice about
    control flow and caches."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(harmony_fx.CaptureError) as info:
        harmony_fx.compile(model, (torch.zeros(2, 3),))
    message = str(info.value)
    assert "Sequential raises on these inputs" in message and "shapes" in message and "dtypes" in message
    assert "control flow" not in message


def test_an_op_failing_on_fake_tensors_is_raised_not_logged(caplog):
    """FakeTensors log each op that fails on them at ERROR with its traceback (934 lines on stderr for
    one failed microbatch capture) before raising; the capture's error is what the user gets, and
    the logger is left as it was."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    filters = list(logger.filters)
    with caplog.at_level(logging.DEBUG), pytest.raises(harmony_fx.CaptureError, match="Sequential raises"):
        harmony_fx.compile(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), (torch.zeros(2, 3),))
    assert not [record for record in caplog.records if "failed while attempting" in record.getMessage()]
    assert logger.filters == filters


class LabelledLoss(nn.Module):
    """DeBERTa's classification head: the loss branches on how many labels are not ignored."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x, labels=None):
        logits = self.linear(x)
        if labels is None:
            return {"logits": logits}
        labelled = (labels >= 0).nonzero()
        if labelled.size(0) > 0:  # export cannot decide this at capture
            return {"logits": logits, "loss": F.cross_entropy(logits, labels)}
        return {"logits": logits, "loss": logits.sum() * 0}


class _GaussianLikelihood(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mean, self.log_variance = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x, y):
        return F.gaussian_nll_loss(self.mean(x), y, self.log_variance(x).exp())


def test_a_check_of_values_inside_torchs_own_function_says_to_call_it_outside():
    """gaussian_nll_loss checks ``torch.any(var < 0)``: the advice was to rewrite control flow the
    user cannot edit."""
    with pytest.raises(harmony_fx.CaptureError, match=r"inside torch's own code \(torch/nn/functional\.py:\d+ in "
                                                       r"gaussian_nll_loss.*outside the model"):
        harmony_fx.compile(_GaussianLikelihood(), (torch.randn(3, 4), torch.randn(3, 2)), devices=["host:0"])


class _BranchesOnValues(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x):
        y = self.linear(x)
        if y.sum() > 0:
            return y * 2
        return y


def test_a_branch_on_values_names_the_models_line_and_no_function_of_torchs():
    """Export's own interposer (torch/_export/non_strict_utils.py) is where every such stop is seen
    from: the message named it as a function of torch's to call outside the model, after the right
    advice."""
    with pytest.raises(harmony_fx.CaptureError) as refused:
        harmony_fx.compile(_BranchesOnValues(), torch.randn(3, 4), devices=["host:0"])
    message = str(refused.value)
    assert "if y.sum() > 0:" in message and "torch.where" in message
    assert "torch's own code" not in message


class _SizedByValue(nn.Module):
    """A pooling over a batch vector that counts the graphs from its values (torch_geometric's
    ``global_mean_pool(x, batch)`` without ``size``)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)

    def forward(self, x, batch):
        graphs = int(batch.max()) + 1
        return torch.zeros(graphs, 4).index_add(0, batch, self.linear(x))


def test_a_size_read_from_values_is_told_to_come_in_as_a_number():
    """The advice was a branch's (torch.where), which does not apply to a size (sweep qq)."""
    with pytest.raises(harmony_fx.CaptureError) as refused:
        harmony_fx.compile(_SizedByValue(), (torch.randn(10, 8), torch.tensor([0, 0, 1, 1, 1, 2, 2, 3, 3, 3])),
                           devices=["host:0"], microbatches=1)
    message = str(refused.value)
    assert "graphs = int(batch.max()) + 1" in message and "pass that number in as an argument" in message
    assert "torch.where" not in message


class _ConnectionistLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 5)

    def forward(self, x, targets, input_lengths, target_lengths):
        return F.ctc_loss(self.linear(x).log_softmax(-1), targets, input_lengths, target_lengths)


def test_an_op_whose_size_depends_on_values_says_to_compute_it_outside():
    """ctc_loss with tensor lengths: export cannot make its intermediate's size; the advice was
    about control flow and caches."""
    x, targets = torch.randn(6, 2, 4), torch.randint(1, 5, (2, 3))
    lengths, target_lengths = torch.tensor([6, 5]), torch.tensor([3, 2])
    with pytest.raises(harmony_fx.CaptureError, match=r"_ctc_loss.*size depends on its inputs' values.*outside"):
        harmony_fx.compile(_ConnectionistLoss(), (x, targets, lengths, target_lengths), devices=["host:0"])


def test_a_loss_export_cannot_trace_names_its_line_and_the_way_around_it():
    model, x, labels = LabelledLoss(), torch.randn(6, 4), torch.tensor([0, 2, 1, -100, 1, 0])
    with pytest.raises(harmony_fx.CaptureError, match=r"test_capture.py:\d+ in forward.*call the model without labels"):
        harmony_fx.compile(model, (x,), {"labels": labels})
    # the way around it the message gives: the loss outside the model, in the Trainer's loss_fn
    reference = copy.deepcopy(model)
    trainer = harmony_fx.Trainer(model, lambda out, target: F.cross_entropy(out["logits"], target),
                                 torch.optim.SGD(model.parameters(), lr=0.1), (x, labels), microbatches=2)
    try:
        loss = trainer.step((x, labels))
    finally:
        trainer.close()
    ref_loss = F.cross_entropy(reference(x)["logits"], labels)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.detach(), (ref - 0.1 * ref.grad).detach())


def test_capture_rejects_a_non_module():
    with pytest.raises(TypeError, match="nn.Module"):
        capture(lambda x: x + 1, (torch.randn(2),))


class ScaledModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x, scale: float = 1.0):
        return self.linear(x) * scale


def test_non_tensor_keyword_input_is_a_constant():
    torch.manual_seed(0)
    model = ScaledModel()
    x = torch.randn(4, 8)
    captured = capture(model, (x,), {"scale": 2.0})
    assert captured.inputs == ["x"]
    hm = harmony_fx.compile(model, (x,), {"scale": 2.0})
    torch.testing.assert_close(hm(x, scale=2.0), model(x, scale=2.0), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["mlp_chain", "residual_mlp"])
def test_symbolic_trace_fallback_trains_like_eager(monkeypatch, name):
    """When torch.export fails, torch.fx.symbolic_trace takes over, with the same guarantees."""
    def export_fails(*args, **kwargs):
        raise RuntimeError("torch.export is switched off for this test")

    monkeypatch.setattr(torch.export, "export", export_fails)
    result = train_step(ZOO[name], 0.5)
    assert result.hm.captured.method == "torch.fx.symbolic_trace"
    assert len(result.hm.packs) > 1
    missing = [n.name for n in result.hm.captured.gm.graph.nodes if n.op != "output" and meta.VAL not in n.meta]
    assert not missing
    assert_step_equal(result)
    assert result.witnessed_peak == result.hm.stats.peak_bytes[result.hm.devices[0].name] <= result.budget
    assert result.hm.stats.as_dict()["bytes_by_kind"] == result.hm.plan.predicted_bytes


class _FrozenTeacher(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.teacher, self.student = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        with torch.no_grad():  # the teacher's branch: eager gives its weights no gradient
            target = self.teacher(x)
        return torch.tanh(self.student(x) + target)


def test_the_symbolic_trace_fallback_refuses_a_forward_that_changes_grad_mode(monkeypatch):
    """A trace runs the no_grad block at trace time and records nothing of it: the teacher's weights
    were trained with the student's (and a forward under autocast computed in fp32), silently."""
    def export_fails(*args, **kwargs):
        raise RuntimeError("torch.export is switched off for this test")

    monkeypatch.setattr(torch.export, "export", export_fails)
    with pytest.raises(harmony_fx.CaptureError, match="changes grad mode or autocast inside"):
        harmony_fx.compile(_FrozenTeacher(), torch.randn(4, 8), devices=["host:0"])


def test_a_bf16_weight_with_fp32_gradients_captures_and_keeps_its_gradient():
    """A parameter whose gradient has another dtype (``Tensor.grad_dtype``, as with the fp32 masters
    on the NVMe tier) captures with export, and keeps its gradient object."""
    model = nn.Linear(4, 2).to(torch.bfloat16)
    grads = []
    for param in model.parameters():
        param.grad_dtype = torch.float32
        param.grad = torch.ones(param.shape)
        grads.append(param.grad)
    captured = capture(model, (torch.randn(3, 4, dtype=torch.bfloat16),))
    assert captured.method == "torch.export"
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))


def test_a_torchscript_module_is_refused_naming_it():
    """Export and symbolic tracing both failed on it, with messages about other things."""
    model = nn.Sequential(torch.jit.script(nn.Linear(8, 16)), nn.ReLU(), nn.Linear(16, 4))
    with pytest.raises(harmony_fx.CaptureError, match=r"the module '0' is TorchScript \(RecursiveScriptModule"):
        harmony_fx.compile(model, (torch.randn(4, 8),), devices=["host:0"])


def test_functional_call_on_the_compiled_module_is_refused_saying_what_to_call_instead():
    """``torch.func.functional_call(hm, params, x)`` (or on a parent holding it) puts plain tensors in
    the model's parameter slots for the call: the capture it sets off was refused by export with
    advice about Python control flow. Refused naming the parameter and functional_call; the
    compiled module works as before once the call has put the parameters back."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    hm = harmony_fx.compile(model, devices=["host:0"])
    parent = nn.Sequential(hm, nn.Tanh())
    x = torch.randn(4, 8)
    params = {name: value.detach().clone().requires_grad_() for name, value in parent.named_parameters()}
    with pytest.raises(CaptureError, match=r"the parameter '0.weight' of Sequential is a plain tensor, not an "
                                           r"nn.Parameter: torch.func.functional_call .*hm.model"):
        torch.func.functional_call(parent, params, (x,))
    hm(x).sum().backward()
    reference(x).sum().backward()
    assert_grads_equal(model, reference)


def test_a_cumulative_batch_norm_is_named_with_what_to_do():
    """``momentum=None``: torch divides by ``float(num_batches_tracked)``, which export cannot keep
    in a graph; the advice was about control flow on tensor values."""
    model = nn.Sequential(nn.Linear(16, 8), nn.BatchNorm1d(8, momentum=None))
    with pytest.raises(harmony_fx.CaptureError) as info:
        harmony_fx.compile(model, (torch.randn(4, 16),), microbatches=1)
    message = str(info.value)
    assert "module 1 (a BatchNorm1d) has momentum=None" in message and "momentum=0.1" in message
    assert "torch.where" not in message


def test_version_0_quantization_aware_training_is_named_with_what_to_do():
    """torch.ao's version-0 QAT qconfig: each FakeQuantize branches on its buffers' values in Python;
    the advice was to use torch.where, inside torch's own code. Version 1 (fused observers) trains."""
    import warnings

    import torch.ao.quantization as tq

    model = nn.Sequential(tq.QuantStub(), nn.Linear(8, 8), nn.ReLU(), tq.DeQuantStub()).train()
    model.qconfig = tq.get_default_qat_qconfig("fbgemm", version=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation
        tq.prepare_qat(model, inplace=True)
    with pytest.raises(harmony_fx.CaptureError) as info:
        harmony_fx.compile(model, (torch.randn(4, 8),), microbatches=1)
    message = str(info.value)
    assert "is a torch.ao.quantization.FakeQuantize (the version-0 QAT qconfig)" in message
    assert "get_default_qat_qconfig(backend) (version 1" in message and "torch.where" not in message


def test_a_path_export_shortened_is_named_whole():
    """Export names a frame's file by a shortened path (``mp/sweep/t13.py`` for ``/tmp/sweep/t13.py``)."""
    from harmony_fx.frontend.capture import _full_path

    assert _full_path(f"{__file__[3:]}:12 in forward") == f"{__file__}:12 in forward"
    assert _full_path("no/such/file.py:3 in forward") == "no/such/file.py:3 in forward"


class _InputGradient(nn.Module):
    """A derivative taken inside the forward (a gradient penalty, score matching)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.linear, self.out = how, nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x):
        energy = lambda sample: self.out(torch.tanh(self.linear(sample))).sum()  # noqa: E731
        if self.how == "torch.func.grad":
            return torch.func.grad(energy)(x)
        if self.how == "torch.autograd.grad":
            x = x if x.requires_grad else x.requires_grad_(True)
            return torch.autograd.grad(energy(x), x, create_graph=True)[0]
        return torch.vmap(lambda sample: torch.relu(self.linear(sample)), out_dims=1)(x)  # vmap's out_dims


@pytest.mark.parametrize("how", ["torch.func.grad", "torch.autograd.grad", "vmap out_dims=1"])
def test_a_derivative_in_the_forward_is_refused_in_words(how):
    """torch.export cannot trace them: the refusal gave the generic advice (control flow, caches), or
    said the model raised as it would called eagerly (it does not: the run that said so had no grad)."""
    model, x = _InputGradient(how), torch.randn(4, 6, 8) if how.startswith("vmap") else torch.randn(4, 8)
    model(x.clone())  # eager runs it
    with pytest.raises(harmony_fx.CaptureError, match=r"computes a derivative inside its forward.*outside the compiled "
                                                      r"model.*out_dims=0") as refused:
        harmony_fx.compile(model, x, devices=["host:0"])
    assert "as it would called eagerly" not in str(refused.value)


@pytest.mark.parametrize("how", ["torch.func.grad", "vmap of torch.func.grad"])
def test_a_derivative_in_the_forward_is_refused_in_words_through_torch_compile(how):
    """Dynamo's graph holds functorch's nesting ops: run on fakes they tripped functorch's internal
    assertion ('wrapper == nullptr INTERNAL ASSERT FAILED'), refused as what the model raises
    called eagerly (it does not) with advice about the inputs' dtypes."""
    model, x = _InputGradient("torch.func.grad"), torch.randn(4, 8)
    if how.startswith("vmap"):
        energy = lambda sample: model.out(torch.tanh(model.linear(sample))).sum()  # noqa: E731
        model.forward = lambda x: torch.vmap(torch.func.grad(energy))(x)
    model(x.clone())  # eager runs it
    torch._dynamo.reset()
    with pytest.raises(harmony_fx.CaptureError, match=r"(?s)_grad_increment_nesting.*computes a derivative inside its "
                                                      r"forward.*outside the compiled model") as refused:
        torch.compile(model, backend="harmony", options={"devices": ["host:0"]})(x)
    assert "as it would called eagerly" not in str(refused.value)


class _ForcesOfAnEnergy(nn.Module):
    """forces = -dE/dx of an input that requires grad: torch.fx.symbolic_trace records the call whole."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x):
        energy = self.out(torch.tanh(self.second(torch.tanh(self.first(x))))).sum()
        return -torch.autograd.grad(energy, x, create_graph=True)[0]


@pytest.mark.parametrize("budget", [None, "9KB"])
def test_a_derivative_the_trace_records_as_one_call_is_refused_in_words(budget):
    """Cut into packs, the call differentiated only its own pack's part of the model: wrong outputs
    and gradients at one budget, a bare autograd error at another, silently right at none."""
    with pytest.raises(harmony_fx.CaptureError, match=r"the forward calls torch\.autograd\.grad(.|\n)*computes a "
                                                      r"derivative inside its forward"):
        harmony_fx.compile(_ForcesOfAnEnergy(), torch.randn(4, 8, requires_grad=True), devices=["host:0"],
                           memory_budget=budget)


class _LearnedScaleAttribute(nn.Module):
    """A learnable scale kept as a plain tensor attribute: eager differentiates it; harmony held it
    as a buffer and it silently never trained."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 8)
        self.scale = torch.ones(8, requires_grad=True)

    def forward(self, x):
        return self.linear(x) * self.scale


def test_a_tensor_requiring_grad_that_is_not_a_parameter_is_refused_naming_it():
    with pytest.raises(harmony_fx.CaptureError, match=r"tensor 'scale', which requires grad but is not an "
                                                      r"nn\.Parameter.*nn\.Parameter\(.*requires_grad_\(False\)"):
        harmony_fx.compile(_LearnedScaleAttribute(), torch.randn(4, 16), devices=["host:0"])
    frozen = _LearnedScaleAttribute()
    frozen.scale.requires_grad_(False)  # a constant: compiles
    harmony_fx.compile(frozen, torch.randn(4, 16), devices=["host:0"])


@dataclasses.dataclass
class _BatchNormOutput:
    logits: torch.Tensor


class _BatchNormToDataclass(nn.Module):
    """A BatchNorm model returning a plain dataclass: export's first try fails, and the run on
    FakeTensors that finds the dataclass must not count a BatchNorm call."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Linear(8 * 6 * 6, 4)

    def forward(self, x):
        return _BatchNormOutput(self.fc(self.bn(self.conv(x)).relu().flatten(1)))


def test_a_forward_run_on_fake_inputs_leaves_the_buffers_as_they_were():
    """The runs on FakeTensors of the inputs (finding an output dataclass; whether the model itself
    raises) ran ``num_batches_tracked.add_(1)`` for real: after one step it was 2 where eager's is 1;
    a refused compile left it changed too, so a BatchNorm(momentum=None) trained afterwards averaged
    with the wrong count."""
    torch.manual_seed(0)
    model = _BatchNormToDataclass()
    reference = copy.deepcopy(model)
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,))
    hm = harmony_fx.compile(model, (x,), memory_budget="64MiB", devices=["host:0"], microbatches=1)
    assert model.bn.num_batches_tracked.item() == 0
    F.cross_entropy(hm(x).logits, y).backward()
    F.cross_entropy(reference(x).logits, y).backward()
    for (name, buffer), expected in zip(model.named_buffers(), reference.buffers()):
        assert torch.equal(buffer, expected), name

    refused = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8, momentum=None))
    before = copy.deepcopy(refused.state_dict())
    with pytest.raises(harmony_fx.CaptureError, match="momentum=None"):
        harmony_fx.compile(refused, (x,), devices=["host:0"], microbatches=1)
    for name, value in refused.state_dict().items():
        assert torch.equal(value, before[name]), name


# a plain assert, as a model's file has it (pytest rewrites the asserts of this file)
_model_file: dict = {}
exec(compile("def lengths_fit(ids):\n    assert (ids != 0).sum(dim=1).long().max().item() <= ids.size(1)\n",
             "<model>", "exec"), _model_file)
_lengths_fit = _model_file["lengths_fit"]


def test_a_value_read_only_to_assert_on_it_is_dropped_not_refused():
    """XLM's ``assert lengths.max().item() <= slen``: the value read into Python is only asserted on
    (export: item -> le -> _assert_scalar), so nothing is sized by it: the model compiles, in
    several packs, and steps as eager does (it was refused as a read into Python)."""

    class Lengths(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(32, 16), nn.Linear(16, 32)

        def forward(self, ids):
            _lengths_fit(ids)
            return F.cross_entropy(self.head(torch.relu(self.embed(ids))).flatten(0, 1), ids.flatten())

    torch.manual_seed(0)
    model = Lengths()
    reference = copy.deepcopy(model)
    ids = torch.randint(1, 32, (4, 8), generator=torch.Generator().manual_seed(1))
    graph = capture(model, (ids,)).gm.graph  # the read, the check and what only they used are gone
    assert not [n for n in graph.nodes if n.target in (torch.ops.aten.item.default, torch.ops.aten.max.default,
                                                       torch.ops.aten.ne.Scalar)]
    budget = smallest_budget(model, (ids,), devices=["host:0"], microbatches=1)
    hm = harmony_fx.compile(model, (ids,), memory_budget=budget, devices=["host:0"], microbatches=1)
    assert len(hm.packs) > 1
    loss = hm(ids)
    loss.backward()
    expected = reference(ids)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    assert_grads_equal(model, reference)


class _ImageTokens(nn.Module):
    """A vision-language model's merge: image features scattered into the image tokens' places,
    after transformers' ``torch_compilable_check`` of their count (``torch._check_tensor_all`` when
    traced)."""

    def __init__(self):
        super().__init__()
        self.embed, self.vision, self.head = nn.Embedding(16, 8), nn.Linear(12, 8), nn.Linear(8, 16)

    def forward(self, ids, pixels):
        h = self.embed(ids)
        features = self.vision(pixels)
        mask = (ids == 3).unsqueeze(-1)
        torch._check_tensor_all(mask.sum() * h.shape[-1] == features.numel())
        h = h.masked_scatter(mask, features)
        return F.cross_entropy(self.head(torch.tanh(h)).flatten(0, 1), ids.flatten())


def test_a_tensor_check_of_values_is_dropped_not_refused():
    """``torch._check_tensor_all(cond)`` is captured as _is_all_true -> item -> sym_ite -> compare ->
    _assert_scalar: a check that sizes nothing, dropped as the plain assert above (Llava, PaliGemma
    and every vision-language model of transformers 5 check their image tokens so; it was refused as
    a read into Python)."""
    torch.manual_seed(0)
    model = _ImageTokens()
    reference = copy.deepcopy(model)
    ids = torch.randint(4, 16, (4, 6), generator=torch.Generator().manual_seed(1))
    ids[:, 1:3] = 3
    pixels = torch.randn(4, 2, 12)
    graph = capture(model, (ids, pixels)).gm.graph
    reads = (torch.ops.aten.item.default, torch.ops.aten._is_all_true.default)
    assert not [n for n in graph.nodes if n.target in reads]
    budget = smallest_budget(model, (ids, pixels), devices=["host:0"], microbatches=1)
    hm = harmony_fx.compile(model, (ids, pixels), memory_budget=budget, devices=["host:0"], microbatches=1)
    assert len(hm.packs) > 1
    loss = hm(ids, pixels)
    loss.backward()
    expected = reference(ids, pixels)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    assert_grads_equal(model, reference)


def test_a_branch_on_values_inside_an_autograd_function_names_the_models_line():
    """Reformer's reversible layers are an autograd Function: a branch on values in its forward is
    refused naming the Function's line, not harmony_fx's recorder it runs under (it named
    ``harmony_fx/ir/autograd_functions.py`` as "the model's code")."""

    class Branchy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2 if x.sum() > 0 else x * 3  # the line named

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.b(Branchy.apply(self.a(x))).sum()

    with pytest.raises(CaptureError) as refused:
        harmony_fx.compile(Model(), (torch.randn(4, 8),), devices=["host:0"])
    assert "harmony_fx/ir" not in str(refused.value)
    assert "test_capture.py" in str(refused.value) and "in forward" in str(refused.value)


class _AssertsOnAValue(nn.Module):
    """torchtune's KVCache.update: ``assert (self.cache_pos[0] + seq_len) <= self.k_cache.shape[2]``."""

    def __init__(self, checked: bool) -> None:
        super().__init__()
        self.linear, self.checked = nn.Linear(4, 4), checked
        self.register_buffer("position", torch.zeros(1, dtype=torch.long))

    def forward(self, x):
        if self.checked:  # as the refusal says to write it
            torch._check(((self.position[0] + x.shape[0]) <= 100).item())
        else:
            assert (self.position[0] + x.shape[0]) <= 100
        return self.linear(x)


def test_an_assert_on_a_tensors_value_is_refused_with_advice_for_an_assert_that_works():
    """The advice was for a branch ("compute both branches and pick with torch.where")."""
    x = torch.randn(2, 4)
    with pytest.raises(CaptureError, match=r"an assert reads a tensor's value.*torch\._check\(condition\.item\(\)\)"):
        harmony_fx.compile(_AssertsOnAValue(checked=False), devices=["host:0"])(x)
    model = _AssertsOnAValue(checked=True)
    torch.testing.assert_close(harmony_fx.compile(model, devices=["host:0"])(x), model.linear(x))


@dataclasses.dataclass
class _BatchInput:
    x: torch.Tensor
    shift: torch.Tensor
    scale: float = 1.0


class _TakesBatchObject(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, batch: _BatchInput):
        h = batch.x * batch.scale - batch.shift
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return h


@pytest.mark.parametrize("microbatches", [2, 1])
def test_a_dataclass_input_is_captured_and_cut_as_its_tensors(microbatches):
    """A batch object (a plain dataclass of tensors) as the input: export refused it as a type pytree
    does not know (the refusal advising about control flow and caches), and with microbatches=2 it
    was "no input is cut along a batch dim". Its type is taught to pytree before the call's
    structure is read, as an output dataclass's is: its tensors are the inputs, cut into
    microbatches, and a float field is keyed on as a plain float input is."""
    torch.manual_seed(0)
    model = _TakesBatchObject()
    reference = copy.deepcopy(model)
    hm = harmony_fx.compile(model, memory_budget=4000, devices=["host:0"], microbatches=microbatches)
    for scale in (1.0, 2.5):
        x = torch.randn(4, 16, requires_grad=True)
        shift = torch.randn(4, 16)
        ref_x = x.detach().clone().requires_grad_()
        model.zero_grad(set_to_none=True), reference.zero_grad(set_to_none=True)
        loss = hm(_BatchInput(x, shift, scale)).pow(2).sum()
        loss.backward()
        ref_loss = reference(_BatchInput(ref_x, shift, scale)).pow(2).sum()
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        assert_grads_equal(model, reference, rtol=1e-5, atol=1e-6, inputs=(x,), ref_inputs=(ref_x,))
    assert len(hm.packs) >= 2 and len(hm.variants) == 2 and len(hm.calls.mb_sizes) == microbatches


class _Outputs(dict):
    pass


class _Pair(list):
    pass


class _ReturnsItsOwnContainers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        hidden = torch.tanh(self.first(x))
        logits = self.second(hidden)
        return _Outputs(logits=logits, hidden=hidden), _Pair([logits, hidden])


def test_a_dict_or_list_subclass_returned_comes_back_as_its_own_type():
    """Export refused the type, and symbolic_trace, which the capture fell back to, returned torch.fx's
    immutable_dict and immutable_list, whose items cannot be set (sweep tt)."""
    torch.manual_seed(0)
    model, x = _ReturnsItsOwnContainers(), torch.randn(4, 8)
    reference = copy.deepcopy(model)
    outputs, pair = harmony_fx.compile(model, (x,), devices=["host:0"], pack_boundaries=(0, 1), microbatches=2)(x)
    expected, expected_pair = reference(x)
    assert type(outputs) is _Outputs and list(outputs) == ["logits", "hidden"] and type(pair) is _Pair
    outputs["extra"] = outputs["logits"]  # as the user's own type allows
    (outputs["logits"].sum() + pair[1].square().sum()).backward()
    (expected["logits"].sum() + expected_pair[1].square().sum()).backward()
    assert_grads_equal(model, reference, rtol=1e-5, atol=1e-6)
