"""Microbatches: cutting a batch (evenly or not), per-input batch dims, and ``harmony_fx.compile``
with ``microbatches=M`` giving eager's loss and gradients with the bytes the plan predicts."""
from __future__ import annotations

import collections
import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

torch.set_num_threads(1)  # tiny ops on a 2-core machine: threads only add synchronisation

import harmony_fx  # noqa: E402
from harmony_fx.frontend import microbatch  # noqa: E402
from harmony_fx.models import MLPChain  # noqa: E402
from harmony_fx.testing.models import ResidualMLP  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6
BATCH = 32


# ---------------------------------------------------------------------- sizes


@pytest.mark.parametrize("batch,num,expected", [
    (10, 4, [3, 3, 2, 2]),
    (32, 3, [11, 11, 10]),
    (32, 4, [8, 8, 8, 8]),
    (7, 7, [1] * 7),
    (5, 1, [5]),
])
def test_microbatch_sizes(batch, num, expected):
    sizes = microbatch.microbatch_sizes(batch, num)
    assert sizes == expected
    assert sum(sizes) == batch
    # the same cut as torch.tensor_split
    assert sizes == [len(chunk) for chunk in torch.tensor_split(torch.arange(batch), num)]


def test_more_microbatches_than_samples_is_refused():
    with pytest.raises(ValueError, match="at most 3 microbatches"):
        microbatch.microbatch_sizes(3, 4)


def test_compile_with_more_microbatches_than_samples_runs_one_sample_each():
    """A batch smaller than ``microbatches`` (a loader's last) is cut into its samples."""
    torch.manual_seed(0)
    model = MLPChain(width=8, depth=2)
    x = torch.randn(3, 8)
    hm = harmony_fx.compile(model, x, microbatches=4)
    assert hm.mb_sizes == [1, 1, 1]
    torch.testing.assert_close(hm(x), model(x))


def test_split_and_merge_round_trip_with_a_shared_input():
    class Two(nn.Module):
        def forward(self, x, bias):
            return x + bias

    x, bias = torch.randn(10, 4), torch.randn(4)
    call = ((x, bias), {})
    dims = microbatch.argument_dims(Two(), (x, bias), {}, {"bias": None})
    assert dims == ((0, None), {})
    assert microbatch.batch_size(call, dims) == 10
    parts = microbatch.split_call(call, dims, [3, 3, 2, 2])
    assert [args[0].shape[0] for args, _ in parts] == [3, 3, 2, 2]
    assert all(args[1] is bias for args, _ in parts)  # passed whole to every microbatch
    torch.testing.assert_close(microbatch.merge([args[0] for args, _ in parts], 0), x, rtol=0, atol=0)
    # a shared value's per-microbatch results (e.g. gradients) are summed
    torch.testing.assert_close(microbatch.merge([torch.ones(4)] * 4, None), torch.full((4,), 4.0))


def test_batch_dims_naming_an_unknown_argument_is_refused():
    model = MLPChain(width=8, depth=2)
    with pytest.raises(ValueError, match="not arguments"):
        harmony_fx.compile(model, torch.randn(8, 8), microbatches=2, batch_dims={"nope": None})


# ---------------------------------------------------------------------- compile(microbatches=M) == eager


def _mlp_chain():
    return MLPChain(width=32, depth=6)


def _residual_mlp():
    return ResidualMLP(width=32, depth=4)


MODELS = {
    # (factory, fixed packs: several packs, so activations and gradients cross pack boundaries)
    "mlp_chain": (_mlp_chain, (0, 3, 5)),
    "residual_mlp": (_residual_mlp, (0, 2, 4)),
}


def _twins(name: str):
    """A zoo-like model, an identical copy for eager, a batch and its targets, and the packs."""
    factory, boundaries = MODELS[name]
    torch.manual_seed(0)
    model = factory()
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 32, generator=generator)
    target = torch.randint(0, 10, (BATCH,), generator=generator)
    return model, reference, x, target, boundaries


@functools.lru_cache(maxsize=None)
def _run(name: str, num_microbatches: int):
    """One training step through harmony_fx (compiled with ``num_microbatches``) and one in eager."""
    model, reference, x, target, boundaries = _twins(name)
    hm = harmony_fx.compile(model, x, microbatches=num_microbatches, pack_boundaries=boundaries)
    out = hm(x)
    loss = F.cross_entropy(out, target)
    loss.backward()
    ref_out = reference(x)
    ref_loss = F.cross_entropy(ref_out, target)
    ref_loss.backward()
    return hm, model, reference, out.detach(), ref_out.detach(), loss.detach(), ref_loss.detach()


CASES = [pytest.param(name, m, id=f"{name}-M{m}") for name in MODELS for m in (1, 3, 4)]


@pytest.mark.parametrize("name,num_microbatches", CASES)
def test_microbatched_step_equals_eager(name, num_microbatches):
    hm, model, reference, out, ref_out, loss, ref_loss = _run(name, num_microbatches)
    assert len(hm.packs) == 3
    assert hm.num_microbatches == num_microbatches
    if num_microbatches == 3:
        assert hm.mb_sizes == [11, 11, 10]  # uneven: two captured sizes share one packing
    assert out.shape == ref_out.shape
    torch.testing.assert_close(out, ref_out, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    ref_params = dict(reference.named_parameters())
    for pname, param in model.named_parameters():
        assert param.grad is not None, f"{pname} has no gradient"
        torch.testing.assert_close(param.grad, ref_params[pname].grad, rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"grad of {pname}: {m}")


@pytest.mark.parametrize("name,num_microbatches", CASES)
def test_microbatched_bytes_equal_plan(name, num_microbatches):
    hm = _run(name, num_microbatches)[0]
    measured = hm.stats.as_dict()["bytes_by_kind"]
    # a microbatch of the input is a view into the batch: the plan counts the bytes it moves, not the
    # batch's whole storage, and as a plain int (it was a SymInt once)
    assert all(type(n) is int for n in hm.plan.predicted_bytes.values()), hm.plan.predicted_bytes
    assert measured == hm.plan.predicted_bytes
    assert measured["h2d/weights"] > 0 and measured["d2h/wgrad"] > 0
    assert hm.plan.microbatches == num_microbatches
    assert hm.stats.peak_bytes[hm.devices[0].name] == hm.plan.predicted_peak[hm.devices[0].name]


@pytest.mark.parametrize("name", list(MODELS))
def test_weights_cross_once_per_iteration_whatever_the_microbatches(name):
    """Grouping (the default): the weights of a pack come in once for all microbatches."""
    moved = {m: _run(name, m)[0].stats.as_dict()["bytes_by_kind"] for m in (1, 3, 4)}
    assert moved[1]["h2d/weights"] == moved[3]["h2d/weights"] == moved[4]["h2d/weights"]
    assert moved[1]["d2h/wgrad"] == moved[3]["d2h/wgrad"] == moved[4]["d2h/wgrad"]


# ---------------------------------------------------------------------- per-input batch dims


class SharedBias(nn.Module):
    """``forward(x, bias)``: ``bias`` (shape ``(width,)``) is shared by every sample."""

    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))
        self.head = nn.Linear(width, 5)

    def forward(self, x, bias):
        for block in self.blocks:
            x = block(x + bias)
        return self.head(x)


def _shared_bias_setup(bias_requires_grad: bool, x_requires_grad: bool):
    torch.manual_seed(0)
    model = SharedBias()
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(10, 16, generator=generator)
    bias = torch.randn(16, generator=generator)
    target = torch.randint(0, 5, (10,), generator=generator)
    x_ref, bias_ref = x.clone().requires_grad_(x_requires_grad), bias.clone().requires_grad_(bias_requires_grad)
    x.requires_grad_(x_requires_grad)
    bias.requires_grad_(bias_requires_grad)
    return model, reference, x, bias, target, x_ref, bias_ref


@pytest.mark.parametrize("bias_requires_grad", [False, True], ids=["bias-const", "bias-grad"])
def test_shared_input_with_batch_dim_none_equals_eager(bias_requires_grad):
    model, reference, x, bias, target, x_ref, bias_ref = _shared_bias_setup(bias_requires_grad, False)
    hm = harmony_fx.compile(model, (x, bias), microbatches=4, batch_dims={"bias": None}, pack_boundaries=(0, 2, 4))
    assert hm.mb_sizes == [3, 3, 2, 2]
    assert len(hm.packs) == 3
    out = hm(x, bias)
    ref_out = reference(x_ref, bias_ref)
    torch.testing.assert_close(out, ref_out, rtol=RTOL, atol=ATOL)
    loss, ref_loss = F.cross_entropy(out, target), F.cross_entropy(ref_out, target)
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    loss.backward()
    ref_loss.backward()
    ref_params = dict(reference.named_parameters())
    for pname, param in model.named_parameters():
        torch.testing.assert_close(param.grad, ref_params[pname].grad, rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"grad of {pname}: {m}")
    if bias_requires_grad:
        # the shared input's gradient is the sum over microbatches, as eager's over the batch
        assert bias.grad is not None and bias.grad.shape == bias.shape
        torch.testing.assert_close(bias.grad, bias_ref.grad, rtol=RTOL, atol=ATOL)
    assert hm.stats.as_dict()["bytes_by_kind"] == hm.plan.predicted_bytes


def test_splitting_a_shared_input_along_dim_0_is_refused():
    """Without ``batch_dims`` the (16,)-shaped bias would be cut along dim 0 too: batch sizes disagree."""
    model, _, x, bias, _, _, _ = _shared_bias_setup(False, False)
    with pytest.raises(ValueError, match=r"disagree on the batch size: x has 10 along dim 0, bias has 16 along dim 0\."
                                         r".* batch_dims=\{'bias': None\}"):
        harmony_fx.compile(model, (x, bias), microbatches=2)


def test_an_index_input_of_another_size_is_no_example_of_what_to_share():
    """A graph batch: node features [12, 16] and edge_index [2, 24]. Sharing edge_index whole (the
    refusal's example before) gave each microbatch indices into the whole batch: torch's IndexError
    from inside a pack (sweep qq). An integer input is not offered; a float one still is."""
    class Graph(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(16, 4)

        def forward(self, x, edge_index, bias):
            return torch.zeros_like(x[:, :4]).index_add(0, edge_index[1], self.linear(x)[edge_index[0]]) + bias

    x, edges, bias = torch.randn(12, 16), torch.randint(0, 12, (2, 24)), torch.randn(4)
    with pytest.raises(ValueError, match=r"disagree on the batch size: x has 12 along dim 0, edge_index has 2 along "
                                         r"dim 0, bias has 4 along dim 0\..*: e\.g\. batch_dims=\{'bias': None\}\.\n"):
        harmony_fx.compile(Graph(), (x, edges, bias), microbatches=2)
    with pytest.raises(ValueError, match=r"a bias\)\.\n"):  # no example left to give
        harmony_fx.compile(Graph(), (x, edges, bias), microbatches=2, batch_dims={"bias": None})


def test_no_input_left_to_cut_is_said_so():
    """Every input shared (the advice above followed for each): a Python error (max() of nothing)."""
    model, _, x, bias, _, _, _ = _shared_bias_setup(False, False)
    with pytest.raises(ValueError, match=r"no input is cut along a batch dim.*microbatches=1, or None"):
        harmony_fx.compile(model, (x, bias), microbatches=2, batch_dims={"x": None, "bias": None})


@pytest.mark.parametrize("microbatches", [1, None, 2])
def test_a_nested_tensor_input_is_refused_naming_it(microbatches):
    """A jagged batch (torch.nested) runs eagerly; capturing it failed in torch's nested code on
    FakeTensors, said as if the model raised eagerly (or, cut, torch's split refused dim 0): now the
    input is named with what to pass instead (sweep qq)."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    nested = torch.nested.nested_tensor([torch.randn(n, 8) for n in (3, 5, 2, 4)], layout=torch.jagged)
    model(nested)  # eager takes it
    with pytest.raises(ValueError, match=r"the input 'input' is a nested tensor \(torch.nested, layout=torch.jagged\)"
                                         r".*to_padded_tensor"):
        harmony_fx.compile(model, (nested,), microbatches=microbatches, memory_budget=1 << 20, devices=["host:0"])


class _DictSubclass(dict):
    pass


class _NeedsAFactory(collections.defaultdict):
    pass


@pytest.mark.parametrize("container", [_DictSubclass, lambda **tensors: [*tensors.values()],
                                       collections.UserDict, lambda **tensors: _NeedsAFactory(None, tensors)],
                         ids=["dict-subclass", "plain-list", "UserDict", "defaultdict-subclass"])
def test_an_input_container_is_taken_apart_or_refused_naming_it(container):
    """A dict subclass is one opaque leaf to pytree: export refused it with advice about control flow
    and caches (sweep tt). One its constructor rebuilds from its items is taken apart (and cut into
    microbatches); one it does not (a defaultdict's factory comes first; a UserDict, as transformers'
    BatchEncoding, is no dict) is named, with what to pass instead."""
    class Reads(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, batch):
            a, b = (batch["a"], batch["b"]) if not isinstance(batch, list) else batch
            return self.linear(a - b)

    batch = container(a=torch.randn(4, 8), b=torch.randn(4, 8))
    if isinstance(batch, (_DictSubclass, list)):
        model = Reads()
        out = harmony_fx.compile(model, devices=["host:0"], microbatches=2)(batch)
        torch.testing.assert_close(out, model(batch))
        return
    with pytest.raises(ValueError, match=rf"the input 'batch' is a {type(batch).__name__}, a container torch's "
                                         r"pytree does not know.*model\(\*\*batch\)"):
        harmony_fx.compile(Reads(), (batch,), devices=["host:0"])


def test_input_that_requires_grad_gets_eager_grad_with_microbatches():
    model, reference, x, bias, target, x_ref, bias_ref = _shared_bias_setup(True, True)
    hm = harmony_fx.compile(model, (x, bias), microbatches=3, batch_dims={"bias": None}, pack_boundaries=(0, 2, 4))
    assert hm.mb_sizes == [4, 3, 3]
    F.cross_entropy(hm(x, bias), target).backward()
    F.cross_entropy(reference(x_ref, bias_ref), target).backward()
    assert x.grad is not None and x.grad.shape == x.shape
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(bias.grad, bias_ref.grad, rtol=RTOL, atol=ATOL)
    ref_params = dict(reference.named_parameters())
    for pname, param in model.named_parameters():
        torch.testing.assert_close(param.grad, ref_params[pname].grad, rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"grad of {pname}: {m}")


def test_input_grad_with_microbatches_on_a_chain():
    torch.manual_seed(0)
    model = MLPChain(width=16, depth=4)
    reference = copy.deepcopy(model)
    x = torch.randn(12, 16)
    target = torch.randint(0, 10, (12,))
    x_ref = x.clone().requires_grad_(True)
    x.requires_grad_(True)
    hm = harmony_fx.compile(model, x, microbatches=4, pack_boundaries=(0, 2))
    F.cross_entropy(hm(x), target).backward()
    F.cross_entropy(reference(x_ref), target).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=RTOL, atol=ATOL)


def test_batch_of_another_size_is_cut_into_as_many_microbatches():
    model = MLPChain(width=8, depth=2)
    hm = harmony_fx.compile(model, torch.randn(8, 8), microbatches=2)
    x = torch.randn(6, 8)
    torch.testing.assert_close(hm(x), model(x), rtol=RTOL, atol=ATOL)
    resized = hm.for_batch((x,), {})
    assert resized is not hm and resized.mb_sizes == [3, 3]


# ---------------------------------------------------------------------- the Trainer's microbatched loss


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_trainer_loss_over_uneven_microbatches_equals_eager(reduction):
    """The Trainer's loss over microbatches of 4, 3, 3 is the batch's loss (size-weighted mean, or
    sum), and one SGD step lands on eager's parameters."""
    torch.manual_seed(0)
    model = MLPChain(width=16, depth=4)
    reference = copy.deepcopy(model)
    x = torch.randn(10, 16)
    target = torch.randint(0, 10, (10,))

    def loss_fn(out, t):
        return F.cross_entropy(out, t, reduction=reduction)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    trainer = harmony_fx.Trainer(model, loss_fn, optimizer, (x, target), microbatches=3,
                                 loss_reduction=reduction, pack_boundaries=(0, 2, 4))
    try:
        assert trainer.hm.mb_sizes == [4, 3, 3]
        for _ in range(2):
            loss = trainer.step((x, target))
            ref_optimizer.zero_grad()
            ref_loss = loss_fn(reference(x), target)
            ref_loss.backward()
            ref_optimizer.step()
            torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL)
            for (pname, param), ref in zip(model.named_parameters(), reference.parameters()):
                torch.testing.assert_close(param.detach(), ref.detach(), rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"{pname}: {m}")
        assert trainer.stats.as_dict()["bytes_by_kind"] == trainer.plan.predicted_bytes
    finally:
        trainer.close()


@pytest.mark.parametrize("name", list(MODELS))
def test_ungrouped_microbatched_step_equals_eager(name):
    """``grouping=False`` (weights once per microbatch) computes the same as grouping."""
    model, reference, x, target, boundaries = _twins(name)
    hm = harmony_fx.compile(model, x, microbatches=4, grouping=False, pack_boundaries=boundaries)
    loss = F.cross_entropy(hm(x), target)
    loss.backward()
    ref_loss = F.cross_entropy(reference(x), target)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad, rtol=RTOL, atol=ATOL)
    moved = hm.stats.as_dict()["bytes_by_kind"]
    assert moved == hm.plan.predicted_bytes
    assert moved["h2d/weights"] > _run(name, 4)[0].stats.as_dict()["bytes_by_kind"]["h2d/weights"]


@pytest.mark.parametrize("as_dict", [False, True], ids=["tuple", "dict"])
def test_trainer_with_a_shared_input_named_in_batch_dims_equals_eager(as_dict):
    """A dict batch is the LossModel's ``**kwargs``: ``batch_dims`` names its keys (Flux's
    ``img_ids``, shared by the batch) as the model's own arguments."""
    model, reference, x, bias, target, x_ref, bias_ref = _shared_bias_setup(False, False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs = {"x": x, "bias": bias} if as_dict else (x, bias)
    trainer = harmony_fx.Trainer(model, F.cross_entropy, optimizer, (inputs, target), microbatches=2,
                                 batch_dims={"bias": None}, pack_boundaries=(0, 2, 4))
    try:
        loss = trainer.step((inputs, target))
    finally:
        trainer.close()
    ref_loss = F.cross_entropy(reference(x_ref, bias_ref), target)
    ref_loss.backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL)
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.detach(), ref.detach(), rtol=RTOL, atol=ATOL)


def test_batch_dims_names_a_keyword_a_forwards_kwargs_takes():
    class Wrapper(nn.Module):
        def forward(self, x, **kwargs):
            return x + kwargs["bias"]

    x, bias = torch.randn(10, 4), torch.randn(4)
    assert microbatch.argument_dims(Wrapper(), (x,), {"bias": bias}, {"bias": None}) == ((0,), {"bias": None})
    with pytest.raises(ValueError, match=r"not arguments of this call; the arguments are \['x', 'bias'\]"):
        microbatch.argument_dims(Wrapper(), (x,), {"bias": bias}, {"nope": None})


def test_a_sum_divided_by_the_batch_size_is_a_mean_over_samples():
    """``kl_div(reduction="batchmean")`` divides by the batch size: each microbatch's graph divides
    by its own, so the microbatches are weighted by their sizes, not added."""

    class BatchMean(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x, target):
            return F.kl_div(F.log_softmax(self.linear(x), -1), target, reduction="batchmean")

    torch.manual_seed(0)
    model = BatchMean()
    reference = copy.deepcopy(model)
    x, target = torch.randn(7, 4), F.softmax(torch.randn(7, 4), -1)
    for microbatches in (3, 7):  # uneven sizes, and equal ones (where the divisors agree)
        hm = harmony_fx.compile(model, (x, target), microbatches=microbatches)
        loss, ref_loss = hm(x, target), reference(x, target)
        torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
        loss.backward()
        ref_loss.backward()
        for param, ref in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(param.grad, ref.grad, rtol=RTOL, atol=ATOL)
            param.grad = ref.grad = None


def test_a_sum_divided_by_a_count_every_microbatch_gets_whole_is_put_back_together():
    """transformers' ``num_items_in_batch``: the loss is summed over labelled tokens and divided by
    their number in the whole batch, a 0-dim input each microbatch gets whole; the microbatches'
    values add up to the batch's, in a training call and in a forward-only one."""

    class CountedLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 5)

        def forward(self, x, labels, num_items):
            return F.cross_entropy(self.linear(x), labels, ignore_index=-100, reduction="sum") / num_items

    torch.manual_seed(0)
    model = CountedLoss()
    reference = copy.deepcopy(model)
    x, labels = torch.randn(10, 4), torch.randint(0, 5, (10,))
    labels[[1, 2, 7]] = -100
    num_items = (labels != -100).sum().float()
    hm = harmony_fx.compile(model, (x, labels, num_items), microbatches=3)  # 4, 3, 3 samples
    loss, expected = hm(x, labels, num_items), reference(x, labels, num_items)
    torch.testing.assert_close(loss, expected, rtol=RTOL, atol=ATOL)
    loss.backward()
    expected.backward()
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad, rtol=RTOL, atol=ATOL)
    with torch.no_grad():
        torch.testing.assert_close(hm(x, labels, num_items), expected.detach(), rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------------- linear combinations of losses


class _Heads(nn.Module):
    """Two outputs per sample and a loss made of them by ``loss(a, b, model)``."""

    def __init__(self, loss) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 6)
        self.loss = loss

    def forward(self, x):
        h = self.linear(x)
        return self.loss(h[:, :4], h[:, 4:], self)


@pytest.mark.parametrize("loss", [
    lambda a, b, m: a.pow(2).mean() + b.abs().mean(),
    lambda a, b, m: (a.pow(2).mean() - 0.5 * b.abs().mean()) / 3,
    lambda a, b, m: a.pow(2).sum() + 2 * b.sum(),
    lambda a, b, m: a.pow(2).sum() / a.shape[0] + b.abs().mean(),       # a sum / the batch size is a mean
    lambda a, b, m: a.pow(2).mean() + 0.01 * m.linear.weight.pow(2).sum(),  # + a penalty without the batch
], ids=["sum-of-means", "scaled-difference", "sum-of-sums", "batchmean-plus-mean", "mean-plus-penalty"])
def test_a_linear_combination_of_means_and_sums_is_put_back_together(loss):
    """One weight per microbatch serves every term that weighs the microbatches alike; uneven
    microbatches (4, 3, 3) make the weights differ."""
    _assert_the_compiled_call_is_eagers(loss, torch.randn(10, 4), 3)


@pytest.mark.parametrize("loss,microbatches", [
    (lambda a, b, m: 0.25 * a.pow(2).sum(), 2),                                  # a constant that is 1 / 4
    (lambda a, b, m: 0.25 * a.pow(2).sum(), 3),
    (lambda a, b, m: a.pow(2).sum() + 0.25 * b.abs().sum(), 2),                  # a VAE's sum + beta * KL
    (lambda a, b, m: a.pow(2).sum() * (1.0 / a.shape[0]) + b.abs().mean(), 3),   # one over the size: a mean
], ids=["quarter-of-a-sum-2", "quarter-of-a-sum-3", "sum-plus-quarter-sum-2", "times-one-over-size-3"])
def test_a_factor_is_a_constant_even_where_it_equals_one_over_the_microbatch_size(loss, microbatches):
    """Eight samples in microbatches of 4: ``0.25 * sum`` was read as a sum over the batch divided
    by its size, weighted a half each (loss and gradients halved, silently), and a sum plus a
    quarter sum refused. A factor that is one over each microbatch's size where the sizes differ
    (3, 3, 2) is still a mean."""
    _assert_the_trainers_step_is_eagers(loss, torch.randn(8, 4), microbatches)


@pytest.mark.parametrize("loss", [
    lambda a, b, m: a.pow(2).sum() / a.numel(),                       # a count that grows with the batch
    lambda a, b, m: a.pow(2).sum() * (1.0 / a.shape[0]),              # one over the size, microbatches alike
    lambda a, b, m: a.pow(2).sum() / a.shape[1],                      # a width that equals the microbatch's size
    lambda a, b, m: a.pow(2).mean() * a.shape[0],                     # a mean times the size: a sum over samples
    lambda a, b, m: F.mse_loss(a, b.repeat(1, 2)).sum(),              # the sum of a mean is that mean
    lambda a, b, m: F.kl_div(F.log_softmax(a.reshape(-1, 2), -1), F.softmax(b.repeat(1, 2).reshape(-1, 2), -1),
                             reduction="batchmean"),                  # per token: divides by batch x tokens
], ids=["over-numel", "times-one-over-size", "over-a-width-equal-to-the-size", "mean-times-size", "sum-of-a-mean",
        "token-batchmean"])
def test_a_number_scaling_a_loss_weighs_the_microbatches_as_the_whole_batchs_graph_says(loss):
    """Each microbatch's graph holds its own number (its size, its element count); whether that
    number is the batch's size, grows with it or is a constant was guessed from the microbatch's size
    (2x, 4x or half the loss, silently). The whole batch's graph says what it is there."""
    x = torch.randn(8, 4)
    _assert_the_compiled_call_is_eagers(loss, x, 2)
    _assert_the_trainers_step_is_eagers(loss, x, 4)


def test_a_cut_by_hand_is_compared_with_the_whole_batch_and_said_not_refused_where_it_differs():
    """The whole batch's graph is captured for every cut by hand (its analysis is judged there) and
    each microbatch's compared with it: where one differs, the caller's cut is said, not refused."""
    for loss in (lambda a, b, m: a.pow(2).mean() + b.abs().mean(),
                 lambda a, b, m: a.pow(2).mean() + b.abs().mean() / 3):
        hm = harmony_fx.compile(_Heads(loss), torch.randn(8, 4), microbatches=2)
        decisions = {stage.name: stage.decision for stage in hm.passes}
        assert "capture whole batch" in decisions
        assert decisions["compare with the whole batch"].endswith("where its graph computes otherwise, said")


def _assert_the_compiled_call_is_eagers(loss, x: torch.Tensor, microbatches: int) -> None:
    """One call of ``_Heads(loss)`` compiled with ``microbatches``, and its backward: eager's loss
    and every gradient."""
    torch.manual_seed(0)
    model = _Heads(loss)
    reference = copy.deepcopy(model)
    hm = harmony_fx.compile(model, x, microbatches=microbatches)
    out, expected = hm(x), reference(x)
    torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)
    out.backward()
    expected.backward()
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad, rtol=RTOL, atol=ATOL)


def _assert_the_trainers_step_is_eagers(loss, x: torch.Tensor, microbatches: int) -> None:
    """One Trainer step of ``_Heads(loss)`` (learning rate 0): eager's loss and every gradient."""
    torch.manual_seed(0)
    model = _Heads(loss)
    reference = copy.deepcopy(model)
    trainer = harmony_fx.Trainer(model, None, torch.optim.SGD(model.parameters(), lr=0.0), x,
                                 microbatches=microbatches)
    try:
        got = trainer.step(x)
    finally:
        trainer.close()
    expected = reference(x)
    expected.backward()
    torch.testing.assert_close(got, expected.detach(), rtol=RTOL, atol=ATOL)
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("microbatches", [1, 3])
def test_the_trainer_puts_a_sum_plus_a_scaled_sum_back_together_whole_or_cut(microbatches):
    """A VAE's loss: a reconstruction sum minus half a KL sum, each microbatch weighing 1. With the
    batch whole, reading its size (``None`` for one microbatch) raised TypeError in the first step."""
    _assert_the_trainers_step_is_eagers(lambda a, b, m: a.pow(2).sum() - 0.5 * (1 + b - b.exp()).sum(),
                                        torch.randn(10, 4), microbatches)


@pytest.mark.parametrize("loss,match", [
    (lambda a, b, m: a.pow(2).sum() + b.abs().mean(), "adds the sum .* to the mean"),
    (lambda a, b, m: a.pow(2).sum() + m.linear.weight.pow(2).sum(), "to a value computed without the batch"),
    (lambda a, b, m: a.pow(2).mean() * b.abs().mean(), "made by .*aten.mul"),
    (lambda a, b, m: a.pow(2).mean() ** 2 + b.abs().mean(), "made by .*aten.pow"),
], ids=["sum-plus-mean", "sum-plus-penalty", "product", "non-linear"])
def test_a_loss_the_microbatches_cannot_weigh_alike_says_what_to_do(loss, match):
    x = torch.randn(10, 4)
    hm = harmony_fx.compile(_Heads(loss), x, microbatches=3)
    with pytest.raises(ValueError, match=match):
        hm(x)


def test_a_planners_cut_that_cannot_weigh_the_loss_falls_back_at_compile():
    """A mean plus a scaled sum: the planner cut the batch (0.01 might have been one over a
    microbatch's size), then the first call refused, telling the user to pass microbatches=1."""

    class MeanPlusScaledSum(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = nn.Linear(16, 16), nn.Linear(16, 6)

        def forward(self, x, y):
            out = self.second(torch.tanh(self.first(x)))
            return F.l1_loss(out, y) + 0.01 * F.mse_loss(out, y, reduction="sum")

    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randn(8, 6)
    model = MeanPlusScaledSum()
    reference = copy.deepcopy(model)
    hm = harmony_fx.compile(model, (x, y), devices=["host:0"], memory_budget=3904)  # one microbatch fits too
    assert hm.num_microbatches == 1 and "fall back" in [stage.name for stage in hm.passes]
    torch.testing.assert_close(hm(x, y), reference(x, y), rtol=RTOL, atol=ATOL)
    hm = harmony_fx.compile(model, (x, y), devices=["host:0"], microbatches=2)  # by hand: said at the call
    with pytest.raises(ValueError, match="weigh differently .*a sum by 1"):
        hm(x, y)


def test_terms_weighed_differently_only_at_run_time_are_refused_then():
    """A mean over labelled tokens plus a mean over every element: alike until a microbatch holds
    more ignored labels than another, which only the batch shows."""

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 3)

        def forward(self, x, labels):
            logits = self.linear(x)
            return F.cross_entropy(logits, labels) + logits.pow(2).mean()

    x, labels = torch.randn(10, 4), torch.randint(0, 3, (10,))
    hm = harmony_fx.compile(Mixed(), (x, labels), microbatches=2)
    hm(x, labels)  # every label counts: the shares are the sizes' in both terms
    labels[:3] = -100
    with pytest.raises(ValueError, match="weigh differently"):
        hm(x, labels)


def test_a_batch_kept_whole_for_sizes_that_disagree_is_explained_without_the_advice():
    """The planner keeps a graph batch whole: ``explain()`` said so with the whole refusal, whose
    advice (pass microbatches=None or 1) the user had followed (sweep qq)."""
    class Graph(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(16, 4)

        def forward(self, x, edge_index):
            return torch.zeros_like(x[:, :4]).index_add(0, edge_index[1], self.linear(x)[edge_index[0]]).sum()

    hm = harmony_fx.compile(Graph(), (torch.randn(12, 16), torch.randint(0, 12, (2, 24))), devices=["host:0"])
    line = next(line for line in hm.explain().splitlines() if line.startswith("batch: "))
    assert line.endswith("disagree on the batch size: x has 12 along dim 0, edge_index has 2 along dim 0"), line
