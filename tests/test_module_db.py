"""PyTorch's own module test database through ``harmony_fx.compile``: models nobody here wrote.

Every float32 training sample of ``torch.testing._internal.common_modules.module_db`` that eager
trains and ``torch.export`` captures (harmony_fx falls back to ``symbolic_trace`` for the others;
they are outside this walk) is compiled twice, with no budget and at the smallest budget
that fits (from ``BudgetTooSmallError.smallest_budget``), and each run is compared with eager on a
copy: every output, every parameter gradient, every input gradient (a fixed random weighting of
the outputs is the loss, so each output's gradient is exercised) and every floating buffer (running
statistics).

The default run takes the first sample of each module; ``-m walk`` walks every sample (hours).
``python -m tests.test_module_db [first module] [last module]`` walks every sample (of the modules
in that range of names) and prints the tally.
"""
from __future__ import annotations

import collections
import copy
import functools
import sys
import warnings

import pytest
import torch
from torch.utils import _pytree as pytree

import harmony_fx
from tests.memory_witness import DeviceMemoryWitness

RTOL, ATOL = 1e-5, 1e-6


@functools.lru_cache(maxsize=None)
def _module_infos() -> dict[str, object]:
    from torch.testing._internal.common_modules import module_db

    return {info.name: info for info in module_db if torch.float32 in info.dtypes}


def _samples(name: str) -> list:
    info = _module_infos()[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return info.module_inputs_func(info, device="cpu", dtype=torch.float32, requires_grad=True, training=True)


def _copy_call(args, kwargs):
    """Fresh leaves with the same values and requires-grad flags."""
    def copy_leaf(x):
        return x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x

    return pytree.tree_map(copy_leaf, (tuple(args), dict(kwargs)))


def _float_leaves(value) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()]


def _step(module, args, kwargs, call=None) -> list[torch.Tensor]:
    """Forward (seeded), then backward of a fixed random weighting of every output; the outputs."""
    torch.manual_seed(0)
    outputs = _float_leaves((call or module)(*args, **kwargs))
    generator = torch.Generator().manual_seed(1)
    loss = sum((out * torch.randn(out.shape, generator=generator)).sum() for out in outputs if out.requires_grad)
    if isinstance(loss, torch.Tensor):
        loss.backward()
    return outputs


def _assert_equal(got, want, what: str) -> None:
    if want is None:
        assert got is None, f"{what}: harmony_fx made a gradient where eager has none"
        return
    assert got is not None, f"{what}: no gradient where eager has one"
    # a sum over microbatches rounds in another order than eager's one sum: an element that cancels
    # to near zero is compared against the size of the whole tensor, not its own
    scale = want.detach().abs().nan_to_num(0, 0, 0).max().item() if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL + RTOL * scale, equal_nan=True,
                               msg=lambda m: f"{what}: {m}")


def check_sample(name: str, index: int) -> str:
    """``"eager fails"``, ``"not exportable"``, or ``"equal"`` once both budgets matched eager;
    raises ``AssertionError`` (or harmony_fx's error) otherwise."""
    info, sample = _module_infos()[name], _samples(name)[index]
    torch.manual_seed(0)
    module = info.module_cls(*sample.constructor_input.args, **sample.constructor_input.kwargs).train()
    args, kwargs = sample.forward_input.args, sample.forward_input.kwargs
    if isinstance(module, torch.nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
        with torch.no_grad():  # its parameters made by a first call, as harmony_fx's refusal says to
            module(*_copy_call(args, kwargs)[0], **_copy_call(args, kwargs)[1])
    try:
        _step(copy.deepcopy(module), *_copy_call(args, kwargs))
    except Exception:  # noqa: BLE001 - an op eager itself cannot run or differentiate
        return "eager fails"
    for budget in ("none", "smallest"):
        options = {"track_memory": True}  # the measured peak (also where conftest does not turn it on: the walk)
        if budget == "smallest":
            with pytest.raises(harmony_fx.BudgetTooSmallError) as error:
                harmony_fx.compile(copy.deepcopy(module), *_copy_call(args, kwargs), memory_budget=1)
            options["memory_budget"] = error.value.smallest_budget
        model, reference = copy.deepcopy(module), copy.deepcopy(module)
        (call_args, call_kwargs), (ref_args, ref_kwargs) = _copy_call(args, kwargs), _copy_call(args, kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                hm = harmony_fx.compile(model, call_args, call_kwargs, **options)
            except harmony_fx.CaptureError:
                if _exports(module, args, kwargs):
                    raise  # torch.export takes it, so the failure is harmony_fx's
                return "not exportable"
            if hm.captured.method != "torch.export":
                return "not exportable"  # captured by symbolic_trace instead: outside this walk
            with DeviceMemoryWitness() as witness:
                outputs = _step(model, call_args, call_kwargs, hm)
            expected = _step(reference, ref_args, ref_kwargs)
        where = f"{name}#{index} at budget {budget}"
        assert len(outputs) == len(expected), where
        for i, (got, want) in enumerate(zip(outputs, expected)):
            _assert_equal(got.detach(), want.detach(), f"{where}: output {i}")
        for (param_name, param), ref in zip(model.named_parameters(), reference.parameters()):
            _assert_equal(param.grad, ref.grad, f"{where}: gradient of {param_name}")
        for i, (x, ref) in enumerate(zip(_float_leaves((call_args, call_kwargs)), _float_leaves((ref_args, ref_kwargs)))):
            _assert_equal(x.grad, ref.grad, f"{where}: gradient of input {i}")
        for (buffer_name, buffer), ref in zip(model.named_buffers(), reference.buffers()):  # running statistics
            if buffer.is_floating_point():
                _assert_equal(buffer, ref, f"{where}: buffer {buffer_name}")
        # the peak by a count apart from the runtime's, equal to it, and within the budget
        assert witness.peak_of(hm.devices[0]) == hm.stats.peak_bytes[hm.devices[0].name], where
        if "memory_budget" in options:
            assert witness.peak_of(hm.devices[0]) <= options["memory_budget"], where
    return "equal"


def _exports(module, args, kwargs) -> bool:
    try:
        torch.export.export(copy.deepcopy(module), *_copy_call(args, kwargs), strict=False)
    except Exception:  # noqa: BLE001
        return False
    return True


def _module_names() -> list[str]:
    try:
        return sorted(_module_infos())
    except Exception:  # noqa: BLE001 - torch's test database not importable: nothing to walk
        return []


# the quick slice less its slowest module (18 s) and those tests/tiers.py moves: the default suite under 8 minutes
_SLOW_FIRST = {"nn.TransformerDecoderLayer"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n in _SLOW_FIRST else [])
                                  for n in _module_names()])
def test_first_sample_trains_like_eager(name):
    if not _samples(name):
        pytest.skip("no float32 training sample")
    outcome = check_sample(name, 0)
    if outcome != "equal":
        pytest.skip(outcome)


@pytest.mark.walk
@pytest.mark.parametrize("name", _module_names())
def test_every_sample_trains_like_eager(name):
    outcomes = collections.Counter(check_sample(name, index) for index in range(len(_samples(name))))
    if not outcomes["equal"]:
        pytest.skip(f"no sample both trains in eager and exports: {dict(outcomes)}")


def _walk(first: str = "", last: str = "~") -> None:
    """Every sample of the modules named from ``first`` to ``last``; prints each failure and the tally."""
    tally: collections.Counter = collections.Counter()
    for name in [n for n in _module_names() if first <= n <= last]:
        for index in range(len(_samples(name))):
            try:
                outcome = check_sample(name, index)
            except Exception as error:  # noqa: BLE001
                outcome = "fails"
                print(f"FAIL {name}#{index}: {type(error).__name__}: {str(error).strip().splitlines()[0][:300]}",
                      flush=True)
            tally[outcome] += 1
    exportable = tally["equal"] + tally["fails"]
    print(dict(tally), f"equal: {tally['equal']}/{exportable} = {tally['equal'] / max(exportable, 1):.1%}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    _walk(*sys.argv[1:3])
    sys.exit(0)
