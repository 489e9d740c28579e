"""frontend.attribute_reads: a module attribute the forward read while captured, or an attribute of a
plain object a module holds (a settings dataclass, a Hugging Face config), is held by the graph
as a constant, so a change to it compiles again (as eager computes with the new value), and switching
back finds the program compiled before; an attribute the forward does not read compiles nothing;
recording leaves ``nn.Module`` as it was, whatever the capture did."""
from __future__ import annotations

import copy
import dataclasses
import threading
import types

import pytest
import torch
from torch import nn

import harmony_fx
from harmony_fx.frontend.attribute_reads import reads_recorded


class _Settings(nn.Module):
    """A forward that reads a number, a flag and a function of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.scale = 2.0
        self.rectify = True
        self.activation = torch.tanh
        self.steps_seen = 0  # the training loop's counter: the forward never reads it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.activation(self.linear(x)) * self.scale
        return torch.relu(y) if self.rectify else y


@pytest.mark.parametrize("change", [{"scale": 3.0}, {"rectify": False}, {"activation": torch.sigmoid}])
def test_a_changed_attribute_the_forward_read_compiles_again_and_computes_as_eager(change):
    torch.manual_seed(0)
    model = _Settings()
    reference = copy.deepcopy(model)
    hm, x = harmony_fx.compile(model, devices=["host:0"]), torch.randn(4, 8)
    torch.testing.assert_close(hm(x), reference(x))
    before = {name: getattr(model, name) for name in change}
    for name, value in change.items():
        setattr(model, name, value)
        setattr(reference, name, value)
    out = hm(x)
    torch.testing.assert_close(out, reference(x))
    out.sum().backward()
    reference(x).sum().backward()
    torch.testing.assert_close(model.linear.weight.grad, reference.linear.weight.grad)
    assert len(hm.variants) == 2
    name = next(iter(change))
    assert f"_Settings.{name}" in list(hm.variants[1][1].passes)[-1].decision
    for name, value in before.items():  # switching back runs the first program again
        setattr(model, name, value)
    hm(x)
    assert len(hm.variants) == 2


def test_an_attribute_the_forward_does_not_read_compiles_nothing():
    model = _Settings()
    hm, x = harmony_fx.compile(model, devices=["host:0"]), torch.randn(4, 8)
    hm(x)
    model.steps_seen += 1
    hm(x)
    assert len(hm.variants) == 1


@dataclasses.dataclass
class _Knobs:
    gain: float = 2.0
    unused: int = 0  # nothing in the forward reads it


class _HoldsKnobs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.knobs = _Knobs()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.knobs.gain


def test_an_attribute_of_a_plain_object_a_module_holds_is_keyed_through_the_module():
    torch.manual_seed(0)
    model = _HoldsKnobs()
    hm, x = harmony_fx.compile(model, devices=["host:0"]), torch.randn(4, 8)
    hm(x)
    model.knobs.unused += 1
    hm(x)
    assert len(hm.variants) == 1
    model.knobs.gain = 3.0
    torch.testing.assert_close(hm(x), model.linear(x) * 3.0)
    assert len(hm.variants) == 2 and "_HoldsKnobs.knobs.gain" in list(hm.variants[1][1].passes)[-1].decision
    model.knobs = _Knobs(gain=-1.0)  # another object in its place is read anew
    torch.testing.assert_close(hm(x), -model.linear(x))
    assert len(hm.variants) == 3
    assert "__getattribute__" not in vars(_Knobs)
    held_whole = _HoldsKnobs()
    held_whole.knobs = types.SimpleNamespace(gain=0.5, unused=0)  # a C class, read whole
    hm = harmony_fx.compile(held_whole, devices=["host:0"])
    hm(x)
    held_whole.knobs.gain = 4.0
    torch.testing.assert_close(hm(x), held_whole.linear(x) * 4.0)


@dataclasses.dataclass(slots=True)
class _SlotKnobs:
    gain: float = 2.0


class _PlainSlots:
    __slots__ = ("gain",)

    def __init__(self) -> None:
        self.gain = 2.0


@pytest.mark.parametrize("knobs", [_SlotKnobs, _PlainSlots], ids=["dataclass-slots", "__slots__"])
def test_an_object_with_slots_a_module_holds_is_keyed_too(knobs):
    """No ``__dict__``: its reads were not recorded (a slot looked like a property), and a change after
    compiling kept the captured value, silently."""
    torch.manual_seed(0)
    model = _HoldsKnobs()
    model.knobs = knobs()
    hm, x = harmony_fx.compile(model, devices=["host:0"]), torch.randn(4, 8)
    hm(x)
    model.knobs.gain = 3.0
    torch.testing.assert_close(hm(x), model.linear(x) * 3.0)
    assert len(hm.variants) == 2 and "__getattribute__" not in vars(knobs)


class _ClassDefault(nn.Module):
    """A flag its class holds as a default (as transformers' ``GradientCheckpointingLayer``), set on
    an instance, or on the class, after compiling."""

    negate = False

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return -y if self.negate else y


def test_a_class_level_default_the_forward_read_is_keyed_set_on_the_instance_or_the_class():
    """Before, only a module's own ``__dict__`` was recorded: a class-level default overridden on
    the instance after compiling went on computing the captured value, silently."""
    torch.manual_seed(0)
    model = _ClassDefault()
    hm, x = harmony_fx.compile(model, devices=["host:0"]), torch.randn(4, 8)
    torch.testing.assert_close(hm(x), model.linear(x))
    model.negate = True
    torch.testing.assert_close(hm(x), -model.linear(x))
    assert len(hm.variants) == 2 and "_ClassDefault.negate" in list(hm.variants[1][1].passes)[-1].decision
    del model.negate
    hm(x)
    assert len(hm.variants) == 2  # back to the first
    try:
        _ClassDefault.negate = True
        torch.testing.assert_close(hm(x), -model.linear(x))
    finally:
        _ClassDefault.negate = False
    assert "__getattribute__" not in vars(nn.Module)


def test_a_hugging_face_config_changed_after_compiling_computes_as_eager():
    """GPT-2's forward reads ``config.output_hidden_states`` and its kin: before, a graph captured
    without hidden states went on returning none after the config asked for them, silently."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    reference = copy.deepcopy(model)
    hm, ids = harmony_fx.compile(model, devices=["host:0"]), torch.randint(0, 50, (2, 8))
    hm(input_ids=ids, labels=ids)
    for changed in (model, reference):
        changed.config.output_hidden_states = True
    out, expected = hm(input_ids=ids, labels=ids), reference(input_ids=ids, labels=ids)
    assert len(out.hidden_states) == len(expected.hidden_states) == 3
    for mine, theirs in zip(out.hidden_states, expected.hidden_states):
        torch.testing.assert_close(mine, theirs)
    torch.testing.assert_close(out.loss, expected.loss)
    assert "__getattribute__" in vars(transformers.PretrainedConfig)  # its own, given back
    assert "__getattribute__" not in vars(type(config))


def test_peft_merging_or_disabling_frozen_adapters_computes_as_eager():
    """PEFT's LoRA layers branch on ``merged_adapters`` and ``_disable_adapters``: after
    ``merge_adapter()`` the graph captured before added the adapters' product to weights that
    already held it (logits off by 0.24, silently); under ``disable_adapter()`` frozen adapters
    (no ``requires_grad`` to change) stayed on."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
    model = peft.get_peft_model(transformers.GPT2LMHeadModel(config),
                                peft.LoraConfig(r=2, target_modules=["c_attn"], init_lora_weights=False))
    for param in model.parameters():
        param.requires_grad_(False)
    reference = copy.deepcopy(model).eval()
    hm, ids = harmony_fx.compile(model, devices=["host:0"]).eval(), torch.randint(0, 50, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(hm(input_ids=ids).logits, reference(input_ids=ids).logits)
        with hm.disable_adapter(), reference.disable_adapter():
            torch.testing.assert_close(hm(input_ids=ids).logits, reference(input_ids=ids).logits)
        for merged in (hm, reference):
            merged.merge_adapter()
        torch.testing.assert_close(hm(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_a_bf16_capture_reads_the_models_own_attributes():
    """``precision="bf16"`` traces a twin of each module in bf16 (``frontend.compute_dtype``): its
    reads are the model's."""
    torch.manual_seed(0)
    model = _Settings()
    hm, x = harmony_fx.compile(model, devices=["host:0"], precision="bf16"), torch.randn(4, 8)
    first = hm(x)
    model.scale = -1.0
    assert not torch.allclose(hm(x), first) and len(hm.variants) == 2


def test_recording_leaves_nn_module_as_it_was_even_when_the_block_raises():
    model = _Settings()
    with pytest.raises(RuntimeError, match="in the block"):
        with reads_recorded(model):
            model(torch.randn(2, 8))
            raise RuntimeError("in the block")
    assert "__getattribute__" not in vars(nn.Module)
    with reads_recorded(model) as reads:
        model(torch.randn(2, 8))
    assert {path for _, path in reads.pairs} >= {("scale",), ("rectify",), ("activation",)}
    assert ("steps_seen",) not in {path for _, path in reads.pairs}
    held = _HoldsKnobs()
    with pytest.raises(RuntimeError, match="in the block"):
        with reads_recorded(held):
            held(torch.randn(2, 8))
            raise RuntimeError("in the block")
    assert "__getattribute__" not in vars(_Knobs) and "__getattribute__" not in vars(nn.Module)


def test_a_compile_in_another_thread_waits_for_the_capture_recording_reads():
    """The recording ``__getattribute__`` is global: a second thread's compile used to fail on an
    internal assertion ("reads_recorded is not reentrant"); it waits for the first capture now."""
    torch.manual_seed(0)
    first, second, x = _Settings(), _Settings(), torch.randn(4, 8)
    entered, leave = threading.Event(), threading.Event()

    def record_first() -> None:
        with reads_recorded(first):
            entered.set()
            leave.wait(timeout=30)

    thread = threading.Thread(target=record_first)
    thread.start()
    entered.wait(timeout=30)
    threading.Timer(0.2, leave.set).start()
    hm = harmony_fx.compile(second, devices=["host:0"])
    torch.testing.assert_close(hm(x), second(x))
    thread.join()
    second.scale = -1.0
    torch.testing.assert_close(hm(x), second(x))
    assert "__getattribute__" not in vars(nn.Module)
