"""The model as the devices run it under ``precision="bf16"``, for ``capture`` to trace.

The devices compute on bf16 copies of the weights and the call's floating inputs, so the graph must
be the one the model makes from bf16 tensors, not from its fp32 masters: a model's own casts follow
its tensors' dtypes (``softmax(x, dtype=torch.float32).to(query.dtype)``, an RMSNorm computing in
fp32 and casting back to its input's dtype), and export bakes the dtype it saw into each. Captured
from fp32 tensors, ``.to(query.dtype)`` is recorded as a cast to fp32 that then meets bf16 weights.

``in_compute_dtype`` builds, without copying a value, a twin of the module tree whose parameters,
buffers and tensor attributes are FakeTensors in the compute dtype (the floating ones; the others
keep theirs), and fake copies of the call's tensors, all in one ``FakeTensorMode``. Export traces
the twin; the names of its parameters and buffers are the model's, so the captured placeholders
map back to the model's own tensors (``original`` for a tensor attribute export lifts as a
constant). The result is what eager computes on ``copy.deepcopy(model).to(dtype)`` with the inputs
cast alike, which is the reference the tests compare against.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils import _pytree as pytree

from harmony_fx.frontend.attribute_reads import note_clone

__all__ = ["Retyped", "fake_in", "in_compute_dtype"]


@dataclasses.dataclass
class Retyped:
    """The twin of a model in the compute dtype, and the example call's tensors made alike."""

    module: nn.Module
    args: tuple
    kwargs: dict
    _originals: dict[int, torch.Tensor]

    def original(self, tensor: torch.Tensor) -> torch.Tensor:
        """The model's own tensor that ``tensor`` (a twin's) stands for; ``tensor`` if none."""
        return self._originals.get(id(tensor), tensor)


def in_compute_dtype(model: nn.Module, args: tuple, kwargs: dict, dtype: torch.dtype) -> Retyped:
    """See the module docstring."""
    mode = FakeTensorMode(shape_env=ShapeEnv())
    made: dict[int, torch.Tensor] = {}      # id of a model's tensor -> its twin
    originals: dict[int, torch.Tensor] = {}  # id of a twin -> the model's tensor

    def twin(tensor: torch.Tensor, parameter: bool = False) -> torch.Tensor:
        if id(tensor) not in made:
            fake = fake_in(mode, tensor, dtype)
            if parameter:
                fake = nn.Parameter(fake, requires_grad=tensor.requires_grad)
            made[id(tensor)] = fake
            originals[id(fake)] = tensor
        return made[id(tensor)]

    clones: dict[int, nn.Module] = {}

    def clone(module: nn.Module) -> nn.Module:
        if id(module) not in clones:
            # copy.copy's way, less __getstate__: a parametrized module's (weight_norm) refuses
            copied = clones[id(module)] = object.__new__(type(module))
            copied.__dict__.update(module.__dict__)
            # a tied weight is one object in the model, and one in the twin
            copied._parameters = {name: None if p is None else twin(p, parameter=True)
                                  for name, p in module._parameters.items()}
            copied._buffers = {name: None if b is None else twin(b) for name, b in module._buffers.items()}
            copied._modules = {name: None if m is None else clone(m) for name, m in module._modules.items()}
            note_clone(copied, module)
        return clones[id(module)]

    root = clone(model)
    # a plain tensor attribute, which export lifts as a constant (a list of parameters, nn.LSTM's
    # _flat_weights, needs nothing: export's own reparametrization sets it)
    for module in clones.values():
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor):
                object.__setattr__(module, name, twin(value))
    fake_args, fake_kwargs = pytree.tree_map_only(torch.Tensor, twin, (args, kwargs))
    return Retyped(root, fake_args, fake_kwargs, originals)


def fake_in(mode: FakeTensorMode, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` as a FakeTensor of ``mode``, in ``dtype`` if it is floating (else in its own), a
    leaf that requires grad where ``tensor`` does."""
    fake = mode.from_tensor(tensor.detach(), static_shapes=True)
    if fake.is_floating_point() and fake.dtype != dtype:
        with mode:
            fake = fake.to(dtype)
    return fake.requires_grad_(tensor.requires_grad)
