"""``frozen_to_bf16=True``: frozen parameters kept in host memory in the compute dtype only.

Under ``precision="bf16"`` the devices read every weight as a bf16 copy. A trainable parameter
needs its fp32 master besides (its update steps it), but a frozen one (``requires_grad=False``)
gets no gradient and no update: after its bf16 copy is made its fp32 value is never read again,
yet it would cost 4 bytes an element on the host plus the 2 of the copy the devices stage. With
the option, the parameter's ``.data`` becomes that bf16 copy before the model is captured: the same
``nn.Parameter`` object (the optimizer, hooks and ``named_parameters`` still hold it), 2 bytes an
element, read by the devices directly (nothing staged), and the values the packs compute with are
those they computed with before, bit for bit. The fp32 values are gone: ``state_dict()`` holds the
frozen weights in bf16 (``load_state_dict`` into an fp32 model casts them back, rounded), which is
why it is an option and not the default.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

__all__ = ["frozen_in_compute_dtype"]


@contextlib.contextmanager
def frozen_in_compute_dtype(model: nn.Module, dtype: torch.dtype | None, on: bool) -> Iterator[None]:
    """With ``on``, every frozen floating parameter of ``model`` wider than ``dtype`` holds its
    ``dtype`` copy from here on; if the block raises (the compile failed), each gets its own tensor
    back, so a failed compile leaves the model as it was."""
    if not on or dtype is None:
        yield
        return
    narrow = torch.empty((), dtype=dtype).element_size()
    originals = []
    for param in {id(p): p for p in model.parameters()}.values():  # a tied parameter once
        if not param.requires_grad and param.is_floating_point() and param.element_size() > narrow:
            originals.append((param, param.data))
            param.data = param.data.to(dtype)
    try:
        yield
    except BaseException:
        for param, data in originals:
            param.data = data
        raise
