"""Values that cross packs: a tensor, or any pytree of them (an LSTM's ``(output, (h, c))``, the list
``split`` returns, a tuple with an int in it).

Every operation the runtime applies to a value (copy to the device or the host, detach, count its
bytes, take it as an input to differentiate) applies to each tensor leaf, and leaves everything else
as it is.

The gradient of a value has the value's structure: a tensor for a tensor, and for a pytree the same
pytree with each leaf's gradient in place, ``None`` where a leaf has none (an integer leaf, or one
that does not require grad). ``None`` is a leaf of ``torch.utils._pytree``, so a gradient flattens
exactly as its value does.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils._mode_utils import no_dispatch

__all__ = ["map_tensors", "tensors", "leaves", "with_leaves", "add_grads", "value_bytes", "empty_fake", "fakes_of",
           "differentiable"]


def differentiable(tensor: torch.Tensor) -> bool:
    """Whether autograd lets ``tensor`` require grad: floating and complex dtypes (a complex weight's
    gradient and what autograd saves for it count as a float one's do)."""
    return tensor.is_floating_point() or tensor.is_complex()


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``value`` with ``fn`` applied to each tensor leaf."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    return pytree.tree_map(lambda leaf: fn(leaf) if isinstance(leaf, torch.Tensor) else leaf, value)


def leaves(value: Any) -> list[Any]:
    """Every leaf of ``value`` (tensors and others), in pytree order."""
    return [value] if isinstance(value, torch.Tensor) else pytree.tree_leaves(value)


def tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, list) and all(isinstance(leaf, torch.Tensor) for leaf in value):
        return value  # a pack's weights or their gradients: no pytree walk on every copy
    return [leaf for leaf in leaves(value) if isinstance(leaf, torch.Tensor)]


def with_leaves(value: Any, new_leaves: Sequence[Any]) -> Any:
    """``value``'s structure with ``new_leaves`` in place of its leaves (e.g. its gradient)."""
    if isinstance(value, torch.Tensor):
        (leaf,) = new_leaves
        return leaf
    return pytree.tree_unflatten(list(new_leaves), pytree.tree_structure(value))


def add_grads(total: Any, grad: Any, inplace: bool) -> Any:
    """Leaf by leaf ``total + grad`` of two gradients of one value (``None`` adds nothing)."""
    def add(a, b):
        if a is None or b is None:
            return b if a is None else a
        return a.add_(b) if inplace else a + b

    return with_leaves(total, [add(a, b) for a, b in zip(leaves(total), leaves(grad), strict=True)])


def value_bytes(value: Any, itemsize: Callable[[torch.Tensor], int] | None = None) -> int:
    """Bytes of the tensors in ``value``: ``numel * itemsize`` each (a view moves only itself)."""
    return sum(t.numel() * (t.element_size() if itemsize is None else itemsize(t)) for t in tensors(value))


def empty_fake(shape: Sequence[int], stride: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new FakeTensor of this layout in the active ``FakeTensorMode``, built from a meta tensor
    directly: what ``torch.empty_strided`` under the mode makes, without the mode's dispatch (its
    cache key alone costs more than the tensor: 30 µs against 100, and 200 for a ``clone``). A
    planning run makes thousands of values that nothing reads (copies, replayed results), the
    requires-grad pass one for each value it cannot reuse. A symbolic size goes through the mode."""
    mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    if mode is None or not all(type(size) is int for size in (*shape, *stride)):
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)
    with no_dispatch():
        elem = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    return FakeTensor(mode, elem, torch.device(device))


def alias_fake(base: torch.Tensor, shape: Sequence[int], stride: Sequence[int], offset: int) -> torch.Tensor:
    """A FakeTensor over ``base``'s storage with this layout and no ``_base``: what ``as_strided``
    and then ``detach`` make, without the mode's dispatch (two cache keys), as ``empty_fake`` does.
    A real tensor, or a symbolic size, goes through the ops."""
    if not isinstance(base, FakeTensor) or not all(type(size) is int for size in (*shape, *stride)):
        return base.as_strided(shape, stride, offset).detach()
    with no_dispatch():
        elem = torch.empty(0, dtype=base.dtype, device="meta").set_(base.untyped_storage(), offset, shape, stride)
    return FakeTensor(base.fake_mode, elem, base.device)


@contextlib.contextmanager
def fakes_of(value: Any) -> Iterator[Any]:
    """``value`` with each tensor as a FakeTensor, inside a ``FakeTensorMode`` (real tensors, a
    model's parameters, still allowed) without grad: a forward run on it computes nothing. Used to
    learn what a model's forward does with inputs before (or instead of) capturing it."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.no_grad():
        yield pytree.tree_map_only(torch.Tensor, mode.from_tensor, value)
