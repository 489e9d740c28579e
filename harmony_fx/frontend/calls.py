"""Calls in and results out: between the caller's ``(args, kwargs)`` and a compiled program's
microbatches.

``Calls`` checks a call against what was compiled (a call of another shape is another program's:
``frontend.guards``), cuts it into each microbatch's flat inputs, puts the microbatches'
outputs back together as eager computes them on the whole batch (concatenated along each output's
batch dim; a scalar loss weighted by ``microbatch.scalar_weights``), rebuilds the model's output
structure, cuts the caller's output gradients into microbatches, and joins the input gradients.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import fx

from harmony_fx.frontend import microbatch
from harmony_fx.ir import meta
from harmony_fx.program.actions import Key, KeyKind

__all__ = ["Calls"]


class Calls:
    """For ``compiled`` (a ``compiler.compiled.Compiled``) of ``model``."""

    def __init__(self, compiled, model) -> None:
        self.compiled = compiled
        self.model = model
        self.mb_sizes = compiled.layout.mb_sizes
        self.inputs = compiled.captured.inputs
        self.outputs = compiled.signature.model_outputs
        # read at every call: the dtype of each input and output in the graph, the caller's dtype of
        # each (they differ under a compute dtype: ``frontend.compute_dtype``), and the output node's args
        self._graph_dtypes = {name: getattr(compiled.nodes[name].meta[meta.VAL], "dtype", None)
                              for name in (*self.inputs, *self.outputs)}
        self._dtypes = {**{name: self._caller_dtype(self._graph_dtypes[name]) for name in self.outputs},
                        **{name: spec[1] for name, spec in zip(self.inputs, compiled.input_specs)}}
        self._output_args = compiled.captured.gm.graph.find_nodes(op="output")[0].args[0]
        if compiled.batch_outputs is not None and len(compiled.batch_outputs) == len(self._output_args):
            # a number the model returns, as the whole batch's graph holds it (x.shape[0]: the batch's)
            self._output_args = tuple(arg if isinstance(arg, fx.Node) else whole
                                      for arg, whole in zip(self._output_args, compiled.batch_outputs))
        # what the model returns unchanged (an input, a parameter, a buffer): handed back as it is
        self._returned_unchanged = {arg.name for arg in self._output_args
                                    if isinstance(arg, fx.Node) and arg.op == "placeholder"}
        self._grad_layouts: dict[tuple, tuple] = {}  # (output, microbatch size) -> its gradient's planned layout

    def _caller_dtype(self, dtype: torch.dtype | None) -> torch.dtype | None:
        """An output computed in the compute dtype comes back in the masters' (their widest
        floating dtype): under ``precision="bf16"`` the caller's model is the fp32 one."""
        if dtype is None or dtype != self.compiled.options.compute_dtype:
            return dtype
        floating = [t.dtype for t in self.compiled.captured.params.values() if t.is_floating_point()]
        return max(floating, key=lambda d: d.itemsize, default=dtype)

    # ------------------------------------------------------------------ calls in
    @property
    def batch_size(self) -> int | None:
        """The batch size this program was compiled for (``None``: no input has a batch dim)."""
        for (shape, _, _), dim in zip(self.compiled.input_specs, self.compiled.flat_dims):
            if dim is not None:
                return sum(self.mb_sizes) if self.mb_sizes[0] is not None else shape[dim]
        return None

    def batch_size_of(self, args: tuple, kwargs: dict) -> int | None:
        """The call's batch size where it differs from this program's (``None``: the same)."""
        flat = self.compiled.captured.flatten_inputs(args, kwargs)
        for given, dim in zip(flat, self.compiled.flat_dims):
            if dim is not None:
                return None if given.shape[dim] == self.batch_size else given.shape[dim]
        return None

    @property
    def input_numel(self) -> int:
        """Elements in the example call's tensor inputs: which of two calls is larger."""
        return sum(shape.numel() for shape, _, _ in self.compiled.input_specs) * len(self.mb_sizes)

    def describe_inputs(self) -> str:
        """The example's first microbatch's inputs and their shapes."""
        return ", ".join(f"{name} {tuple(shape)}" for name, (shape, _, _) in zip(self.inputs, self.compiled.input_specs))

    def describe_call(self) -> str:
        """The example call's inputs and their shapes, whole (the batch dim the call's, not a microbatch's)."""
        whole = self.batch_size
        return ", ".join(
            f"{name} {tuple(shape) if dim is None else tuple(whole if d == dim else n for d, n in enumerate(shape))}"
            for name, (shape, _, _), dim in zip(self.inputs, self.compiled.input_specs, self.compiled.flat_dims))

    def split(self, args: tuple, kwargs: dict) -> list[list[torch.Tensor]]:
        """The flat tensor inputs of each microbatch, checked against the example."""
        compiled = self.compiled
        call = (args, kwargs)
        if len(self.mb_sizes) == 1:
            calls = [call]  # one microbatch: the call itself, its shapes checked below
        else:
            dims = microbatch.argument_dims(self.model, args, kwargs, compiled.options.batch_dims)
            sizes = [s for s in self.mb_sizes if s is not None]
            if sizes and microbatch.batch_size(call, dims) != sum(sizes):
                raise ValueError(f"the batch has {microbatch.batch_size(call, dims)} samples but the model was "
                                 f"compiled for {sum(sizes)}; compile again for the new batch size.")
            calls = microbatch.split_call(call, dims, sizes or [0])
        per_mb = []
        for size, (mb_args, mb_kwargs) in zip(self.mb_sizes, calls):
            variant = compiled.variants[size]
            flat = variant.captured.flatten_inputs(mb_args, mb_kwargs)
            for given, name in zip(flat, self.inputs):
                expected = variant.nodes[name].meta[meta.VAL]
                if given.shape != expected.shape or given.dtype != self._dtypes[name]:
                    raise ValueError(
                        f"input {name!r} has shape {tuple(given.shape)} and dtype {given.dtype} in a microbatch, but "
                        f"the model was compiled for {tuple(expected.shape)} and {self._dtypes[name]}; compile again "
                        "for the new shape.")
            per_mb.append([self._in_graph_dtype(name, x) for name, x in zip(self.inputs, flat)])
        if [x.requires_grad for x in per_mb[0]] != [spec[2] for spec in compiled.input_specs]:
            raise ValueError("which inputs require grad differs from the example inputs; compile with inputs "
                             "that require grad exactly where the calls do.")
        return per_mb

    # ------------------------------------------------------------------ results out
    def merge_outputs(self, iteration) -> tuple[torch.Tensor, ...]:
        """Each model output on the whole batch, from the microbatches' in ``iteration.host_values``
        (a scalar's weights are kept in ``iteration.scalar_weights`` for its gradient)."""
        values = iteration.host_values
        num = len(self.mb_sizes)
        home = self._home
        outputs = []
        for name in self.outputs:
            chunks = [values[Key(KeyKind.ACT, name, mb)] for mb in range(num)]
            dtype = self._dtypes[name]
            if len(chunks) > 1 and chunks[0].dim() == 0:  # a loss: weighted as eager reduces the whole batch
                per_mb = [[values[Key(KeyKind.ACT, n, mb)] for n in self.inputs] for mb in range(num)]
                iteration.scalar_weights[name] = self.scalar_weights(name, per_mb)
                outputs.append(microbatch.merge_scalars(chunks, iteration.scalar_weights[name]).to(home, dtype))
                continue
            dim = self.compiled.output_dims.get(name, 0)
            if dim is not None and len(chunks) > 1 and all(chunk is not None for chunk in chunks):
                iteration.output_parts[name] = [chunk.shape[dim] for chunk in chunks]
            try:
                merged = microbatch.merge([chunk.to(home, dtype) for chunk in chunks], dim)
            except RuntimeError as error:  # chunks of other sizes than along ``dim``: its batch is not there
                raise ValueError(
                    f"the microbatches' output {name!r} ({', '.join(str(tuple(c.shape)) for c in chunks)}) cannot be "
                    f"joined along its dim {dim}: that dim is not its batch (an unbatched input, a sequence-first "
                    "value: name each input's batch dim with batch_dims), or pass microbatches=1.") from error
            # not the object the iteration holds (one microbatch's output, merged as itself): autograd
            # gives the returned tensor a grad_fn holding the iteration, and that cycle would keep the
            # last pack on the device past a forward whose backward never comes (a metric without no_grad)
            outputs.append(merged.detach() if any(merged is chunk for chunk in chunks) else merged)
        return tuple(outputs)

    @property
    def _home(self) -> torch.device | None:
        """Where results go: beside resident weights, on their device (the caller's loss and targets
        are there); else in host memory, where the program leaves them."""
        return self.compiled.devices[0].torch_device if self.compiled.resident_weights else None

    def structure(self, tensors: Sequence[torch.Tensor], args: tuple, kwargs: dict) -> Any:
        """The model's output structure (tuple, dict, ``ModelOutput``) around the merged outputs of
        the call ``(args, kwargs)``; an input, parameter or buffer the model returns unchanged is the
        caller's own tensor, as in eager (its gradient goes straight to it)."""
        captured = self.compiled.captured
        by_name = dict(zip(self.outputs, tensors))
        if self._returned_unchanged:
            state = {**captured.params, **captured.buffers, **dict(zip(self.inputs, captured.flatten_inputs(args, kwargs)))}
            by_name.update((name, state[name]) for name in self._returned_unchanged)
        flat = [by_name[arg.name] if isinstance(arg, fx.Node) else arg for arg in self._output_args]
        return captured.unflatten_outputs(flat)

    def put_output_grads(self, iteration, grad_outputs: Sequence[torch.Tensor | None]) -> None:
        """The caller's gradients of the outputs, cut into the microbatches' (a loss's: scaled by
        each microbatch's weight), into ``iteration.host_values``."""
        sizes = [s for s in self.mb_sizes if s is not None]
        differentiable = self.compiled.signature.differentiable
        for name, grad in zip(self.outputs, grad_outputs):
            if name not in differentiable:
                continue
            if grad is None:  # the caller's loss does not reach it: nothing flows back from it
                for mb in range(len(self.mb_sizes)):
                    iteration.host_values[Key(KeyKind.GRAD, name, mb)] = None
                continue
            if name in iteration.scalar_weights:
                chunks = [grad * weight for weight in iteration.scalar_weights[name]]
            else:
                dim = self.compiled.output_dims.get(name, 0)
                parts = iteration.output_parts.get(name, sizes)  # rows picked by a mask: as many as each gave
                chunks = torch.split(grad, parts, dim) if len(sizes) > 1 else (grad,)
            for mb, chunk in enumerate(chunks):
                iteration.host_values[Key(KeyKind.GRAD, name, mb)] = self._as_planned(
                    Key(KeyKind.GRAD, name, mb), self._in_graph_dtype(name, chunk))

    def _as_planned(self, key: Key, grad: torch.Tensor) -> torch.Tensor:
        """An output's gradient laid out as the plan ran the backward with it (the output's own strides):
        the caller's (contiguous from a weighted sum, an expand from ``.sum()``) would make a
        transposed output's backward copy it where the plan did not (out of memory at the smallest
        budget). A copy on the host, only where the layouts differ."""
        shape, stride = self._planned_layout(key.name, self.mb_sizes[key.mb])
        if shape is None or tuple(grad.shape) != shape or grad.stride() == stride:
            return grad
        return torch.empty_strided(shape, stride, dtype=grad.dtype, device=grad.device).copy_(grad)

    def _planned_layout(self, name: str, mb_size: int | None) -> tuple[tuple | None, tuple | None]:
        """The shape and strides the plan gave output ``name``'s gradient at a microbatch of ``mb_size``
        (read from the graph once, not at every call)."""
        if (name, mb_size) not in self._grad_layouts:
            planned = self.compiled.shapes.value_of(Key(KeyKind.GRAD, name, self.mb_sizes.index(mb_size)))
            self._grad_layouts[name, mb_size] = ((tuple(planned.shape), tuple(planned.stride()))
                                                 if isinstance(planned, torch.Tensor) else (None, None))
        return self._grad_layouts[name, mb_size]

    def _in_graph_dtype(self, name: str, value: torch.Tensor) -> torch.Tensor:
        dtype = self._graph_dtypes[name]
        return value if dtype is None or value.dtype == dtype else value.to(dtype)

    def input_grads(self, iteration) -> list[torch.Tensor | None]:
        """The gradient of each flat input on the whole batch (``None`` where it has none)."""
        grads = []
        for name, dim in zip(self.inputs, self.compiled.flat_dims):
            dtype = self._dtypes[name]
            chunks = [iteration.host_values.get(Key(KeyKind.GRAD, name, mb)) for mb in range(len(self.mb_sizes))]
            grads.append(microbatch.merge([c if c is None else c.to(self._home, dtype) for c in chunks], dim))
        return grads

    def scalar_weights(self, name: str, per_mb: Sequence[Sequence[torch.Tensor]],
                       otherwise: Callable[[], list[float]] | None = None,
                       total: Callable[[float], float] | None = None) -> list[float]:
        """Each microbatch's coefficient in the batch's value of the scalar output ``name`` (its
        loss), from how the graph reduces it (``analysis.reductions.scalar_reduction``), given each
        microbatch's flat inputs ``per_mb``. Where the graph does not say, ``otherwise()`` if given
        (asked for only then: across processes it is a collective), else a ``ValueError`` saying
        what to do. ``total``: the whole batch's normaliser (``microbatch.scalar_weights``)."""
        reductions = [self.compiled.variants[size].captured.reductions[name] for size in self.mb_sizes]
        if otherwise is not None and any(reduction.combine is None for reduction in reductions):
            return otherwise()
        inputs = [dict(zip(self.inputs, flat)) for flat in per_mb]
        # one microbatch (size None) is the whole batch, of the size compiled: a divisor may be it
        sizes = self.mb_sizes if self.mb_sizes[0] is not None else [self.batch_size]
        whole = (self.compiled.batch_reductions or {}).get(name)
        return microbatch.scalar_weights(reductions, inputs, sizes, total, whole)

    def output_like(self, name: str) -> torch.Tensor:
        """An empty tensor shaped as the model's output ``name`` on the whole batch (a scalar, such
        as a loss, stays a scalar)."""
        vals = [self.compiled.variants[size].nodes[name].meta[meta.VAL] for size in self.mb_sizes]
        if len(vals) == 1 or vals[0].dim() == 0:
            return torch.empty(vals[0].shape, dtype=vals[0].dtype)
        dim = self.compiled.output_dims.get(name, 0)
        shape = list(vals[0].shape)
        shape[dim] = sum(v.shape[dim] for v in vals)
        return torch.empty(shape, dtype=vals[0].dtype)
