"""Can the batch be cut? The batch dim of every value of a captured graph, or the op that mixes samples.

Microbatches give eager's numbers only when every op treats the samples apart: a softmax over the
batch dim, a ``GLU`` splitting it, an unbatched LSTM whose dim 0 is time, a ``BatchNorm`` in
training all compute something else on a part of the batch. The planner cuts the batch only when
this analysis proves it safe; an option the user sets is theirs.

1. Each model input starts at its batch dim (``batch_dims``), or ``None``: shared whole by every
   microbatch. Parameters and buffers are shared.
2. Each node maps its inputs' batch dims to its outputs' by its op's rule (pointwise ops align
   dims as broadcasting does; views and reshapes follow the sizes; reductions, ``softmax``, ``cat``,
   indexing and the like may not act along the batch dim; matmul, convolution, pooling, norms,
   attention, RNNs and losses by what they compute). A batch dim is a factor of its dim: the
   outer one (``[B, S, H] -> [B*S, H]`` keeps it at dim 0), or *interleaved* with an outer factor
   (``[S, B, H] -> [S*B, H]``, as ``nn.MultiheadAttention`` merges time and batch around its output
   projection): each sample still owns whole rows of that dim, so ops that treat its rows apart
   (pointwise, ``linear``, a norm or softmax over other dims, views that keep it) keep it, a
   reshape may split it back out (``[S*B, H] -> [S, B, H]``), and every other op, an in-place
   write or a model output meeting it makes the graph not separable. A mixture of experts' rows
   sorted by expert and put back are followed as that one chain of ops (``tokens sorted by
   expert`` below), and a model's own autograd Function by its forward and backward, traced.
3. Shared values are followed too: along which dims each is constant (``zeros``, an ``expand``ed
   size-1 dim, what is computed from those), and which are ``arange(B)``, each sample's own index
   (``mask[arange(B)[:, None], positions]`` picks each sample's row: it stays separable).
   An in-place op writes into the buffer its first argument views (``shifted[:, 1:] = ids[:, :-1]``
   into ``shifted = ids.new_zeros(...)``, a fresh constant: ``ids`` gives it only a dtype): the
   buffer and every view of it hold what was written from then on, the batch dim mapped back
   through the views, which may neither cut nor merge it.
   A draw of independent numbers with exactly one dim of the batch's size (stochastic depth's
   ``torch.rand((B, 1, 1))``, timm's ``x.new_empty((B, 1)).bernoulli_(p)``) is each sample's own
   along that dim: a microbatch draws its own alike (not ``randperm``, whose entries depend on
   each other).
4. An op acting along the batch dim, an op this module has no rule for, and a shared value that
   varies along the batch dim meeting a batched one (a ``[B, H]`` parameter added to ``[B, H]``
   activations) all make the graph *not separable*; the first such node is the reason given.
5. A sum or mean over the batch down to a number (a loss) may only go on to other numbers (not
   meet the samples again) and end in a scalar model output. Whether that output can be put back
   together from microbatches (a mean, a sum, a linear combination of them: ``loss_a.mean() +
   loss_b.mean()``) is decided by ``reductions.scalar_reduction``, the one analysis of how a loss
   reduces, which also gives the runtime its weights; this module does not decide it again.

Returns the batch dim of each model output (what microbatch outputs are concatenated along).
"""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, Mapping, Sequence

import torch
from torch import fx
from torch.utils import _pytree as pytree

from harmony_fx.analysis.aliasing import alias_chain, aliased
from harmony_fx.analysis.random_ops import draws_random
from harmony_fx.analysis.reductions import ScalarReduction, scalar_reduction
from harmony_fx.ir import autograd_functions, meta
from harmony_fx.ir.values import leaves

__all__ = ["BatchAnalysis", "analyze_batch_dims"]

aten = torch.ops.aten


class _Mixed(Exception):
    """A node mixes samples; the message says which and how."""


_REDUCED = "reduced"  # a sum or mean over the batch (a loss), valid only on its way to an output


@dataclasses.dataclass(frozen=True)
class BatchAnalysis:
    """``separable``: cutting the batch computes what the whole batch does; ``reason``: why not
    (naming the node); ``output_dims``: per model output, by its position among the graph's outputs
    (the same in every capture of the model, whatever its nodes are named at another batch size),
    its batch dim (``None`` for a scalar reduced over the batch)."""

    separable: bool
    reason: str = ""
    output_dims: Mapping[int, int | None] = dataclasses.field(default_factory=dict)
    # False where an output has no one batch dim to join microbatches' outputs along (it holds the
    # batch interleaved or sorted, or does not depend on it): a cut would return another tensor
    joinable: bool = True
    # the values that are ``arange(B)`` along a dim (each sample's own index, step 3): separable
    # when every microbatch computes its own, wrong if a larger forward microbatch's is cut apart
    batch_indices: tuple[str, ...] = ()
    # where separable, each batched value's batch dim (by node name): a microbatch's graph must
    # hold the same value with that dim scaled by its share of the batch
    value_dims: Mapping[str, int] = dataclasses.field(default_factory=dict)


def analyze_batch_dims(gm: fx.GraphModule, input_dims: Mapping[str, int | None], batch_size: int,
                       reductions: Mapping[str, ScalarReduction] | None = None) -> BatchAnalysis:
    """``input_dims``: model input placeholder name -> its batch dim (``None``: shared whole);
    ``batch_size``: the number of samples along those dims; ``reductions``: how each scalar output
    reduces the batch (``Captured.reductions``; ``None``: read from ``gm`` here)."""
    if not any(dim is not None for dim in input_dims.values()):
        return BatchAnalysis(False, "no input is cut along a batch dim")
    try:
        env, context = _propagate(gm, {name: [dim] for name, dim in input_dims.items()}, batch_size)
    except _Mixed as mixed:
        return BatchAnalysis(False, str(mixed))
    output_dims = {}
    for position, arg in enumerate(gm.graph.find_nodes(op="output")[0].args[0]):
        if not isinstance(arg, fx.Node):
            continue
        (dim,) = env[arg][:1] or [None]
        if dim is None and arg.op == "placeholder" and meta.role_of(arg) != meta.Role.INPUT:
            continue  # a parameter or buffer returned as it is: the caller gets it back, nothing is joined
        if dim is None:
            return BatchAnalysis(False, f"the output {arg.name} does not depend on the batch: every microbatch "
                                        "would compute it whole (a parameter's slice, a constant the model makes; "
                                        "under torch.compile, a value made inside the model that Dynamo hands "
                                        "across a graph break, such as an attention mask)", joinable=False)
        if arg in context.sorted:
            return BatchAnalysis(False, f"the output {arg.name} holds the batch's rows in a sorted order",
                                 joinable=False)
        if context.outer.get(arg, 1) > 1:
            return BatchAnalysis(False, f"the output {arg.name} holds the batch interleaved with another dim (a "
                                        "reshape merged them, as view(-1, n) of a [time, batch, n] tensor does): "
                                        "microbatches' outputs cannot be joined along one dim", joinable=False)
        if dim == _REDUCED:
            # whether a loss can be put back together from microbatches is scalar_reduction's call,
            # the same one that gives the runtime its weights
            reduction = (reductions or {}).get(arg.name) or scalar_reduction(gm, arg)
            if reduction.combine is None:
                return BatchAnalysis(False, reduction.why)
            if reduction.weighed_by_labels:
                return BatchAnalysis(False, reduction.weighed_by_labels)
        output_dims[position] = None if dim == _REDUCED else dim
    indices = tuple(node.name for node in context.iota
                    if context.is_batch_index(node) is not None or node in context.full_ranges)
    value_dims = {node.name: dims[0] for node, dims in env.items()
                  if len(dims) == 1 and isinstance(dims[0], int) and node.op != "placeholder"}
    return BatchAnalysis(True, output_dims=output_dims, batch_indices=indices, value_dims=value_dims)


# ----------------------------------------------------------------------------------- propagation

_Dims = list  # one entry per leaf of a node's value: an int, None (shared), or _REDUCED


def _propagate(gm: fx.GraphModule, env_inputs: Mapping[str, _Dims],
               batch_size: int) -> tuple[dict[fx.Node, _Dims], _Context]:
    env: dict[fx.Node, _Dims] = {}
    c = _Context(env, {}, {}, batch_size)
    placeholders = gm.graph.find_nodes(op="placeholder")
    for node in placeholders:
        env[node] = list(env_inputs.get(node.name, [None] * len(leaves(node.meta.get(meta.VAL)))))
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "get_attr":
            env[node] = [None]
            continue
        inputs = [arg for arg in node.all_input_nodes]
        if _name(node) in _FRESH:  # ``x.new_zeros(size)``: x gives only its dtype and device, no values
            inputs = [arg for arg in inputs if arg is not node.args[0]]
        elif _name(node) == "type_as":  # ``x.type_as(y)``: y gives only its dtype
            inputs = inputs[:1]
        if all(all(d is None for d in env[arg]) for arg in inputs) and not any(arg in c.sorted for arg in inputs):
            if (drawn := _per_sample_draw(node, batch_size)) is not None:
                env[node] = [drawn]
                continue
            # nothing batched comes in: the result is shared; follow what it is constant along
            env[node] = [None] * max(len(leaves(node.meta.get(meta.VAL))), 1)
            if isinstance(node.meta.get(meta.VAL), torch.Tensor) and isinstance(node.target, torch._ops.OpOverload):
                _follow_shared(node, c)
                if _written(node) is not None:
                    _write_shared(node, c)
            continue
        if any(_REDUCED in env[arg] for arg in inputs):
            value = node.meta.get(meta.VAL)
            if isinstance(value, torch.Tensor) and value.dim() == 0 and all(
                    set(env[arg]) <= {_REDUCED, None} for arg in inputs):
                env[node] = [_REDUCED]  # still a number for the whole batch: see step 5
                continue
            if value is None or _name(node) in _SIZE_QUERIES:  # an assertion on the loss, not a use of it
                env[node] = [None] * max(len(leaves(value)), 1)
                continue
            raise _Mixed(f"{meta.describe(node)} computes with a loss reduced over the whole batch")
        if not any(isinstance(leaf, torch.Tensor) for leaf in leaves(node.meta.get(meta.VAL))):
            if _name(node) in _SIZE_QUERIES:  # a size, not the samples' values
                env[node] = [None]
                continue
            raise _mixed(node, "turns batched values into a Python number")
        try:
            env[node] = _apply(node, c)
            _check_in_range(node, env[node], c.batch_size)
            if _written(node) is not None and node not in c.sorted:
                _write(node, c)
        except _Mixed:
            raise
        except Exception as error:  # noqa: BLE001 - an op we cannot read is one we cannot prove safe
            # (the rule's own failure, a Python error, is not the user's to read: its type, for a report)
            raise _Mixed(f"{meta.describe(node)}: has no rule that applies to these arguments "
                         f"({type(error).__name__} in the rule)") from error
    return env, c


def _check_in_range(node: fx.Node, dims: _Dims, batch_size: int) -> None:
    """Every batch dim a rule gives is one of its value's dims, holding whole samples: a rule that
    misreads an op's shape (a rank it drops) is caught here, not where outputs are joined."""
    for dim, value in zip(dims, leaves(_val(node))):
        if isinstance(dim, int) and not (isinstance(value, torch.Tensor) and 0 <= dim < value.dim()
                                         and value.shape[dim] % batch_size == 0):
            raise _Mixed(f"{meta.describe(node)}: has no rule that applies to these arguments (its rule gives "
                         f"the batch dim {dim} to a value shaped {list(getattr(value, 'shape', []))})")


# draws of independent numbers, each entry its own (not ``randperm``, whose entries depend on each other)
_INDEPENDENT_DRAWS = frozenset({"rand", "randn", "randint", "bernoulli", "bernoulli_", "uniform_", "normal", "normal_",
                                "exponential_", "geometric_", "cauchy_", "log_normal_", "random_", "rand_like",
                                "randn_like", "randint_like", "native_dropout", "dropout"})


def _per_sample_draw(node: fx.Node, batch_size: int) -> int | None:
    """The dim of a draw of independent numbers that is the batch's size, where it has exactly one
    (``torch.rand((B, 1, 1))``: stochastic depth's mask, a number per sample): each sample's own
    numbers along it, so a microbatch drawing its own draws alike (other numbers, as every cut of a
    model that draws does: the planner does not cut those itself)."""
    value = node.meta.get(meta.VAL)
    if batch_size < 2 or not isinstance(value, torch.Tensor) or _name(node) not in _INDEPENDENT_DRAWS \
            or not draws_random(node):
        return None
    dims = [dim for dim, size in enumerate(value.shape) if size == batch_size]
    return dims[0] if len(dims) == 1 else None


def _val(node: Any) -> Any:
    return node.meta.get(meta.VAL) if isinstance(node, fx.Node) else node


def _shape(node: Any) -> tuple[int, ...]:
    return tuple(_val(node).shape)


def _dim(env, node: Any) -> int | None:
    if not isinstance(node, fx.Node):
        return None
    dims = env[node]
    assert len(dims) == 1, f"{node.name} is not one tensor"
    return dims[0]


def _norm(dim: int, rank: int) -> int:
    return dim % rank if rank else 0


def _mixed(node: fx.Node, why: str) -> _Mixed:
    return _Mixed(f"{meta.describe(node)} {why}")


@dataclasses.dataclass
class _Context:
    env: dict[fx.Node, _Dims]
    # shared values: the dims each is constant along (equal entries), and the arange(n)-like ones
    # (each entry equal to its index along one dim): node -> that dim
    constant: dict[fx.Node, frozenset[int]]
    iota: dict[fx.Node, int]
    batch_size: int
    # batched values whose batch is interleaved in its dim (step 2): node -> the number of blocks of
    # rows above it (``S`` for ``[S*B, H]``); absent: the batch is the dim's outer factor
    outer: dict[fx.Node, int] = dataclasses.field(default_factory=dict)
    # shared values made of copies of a block along a dim: node -> {dim: copies}
    tiled: dict[fx.Node, dict[int, int]] = dataclasses.field(default_factory=dict)
    # values made by sorting the batch's rows (``tokens sorted by expert``): node -> (what it is, the sort)
    sorted: dict[fx.Node, tuple[str, fx.Node]] = dataclasses.field(default_factory=dict)
    # aranges over the whole of a batched dim the batch is merged into (``[B * C]``: multiple choice),
    # which index it as arange(B) does
    full_ranges: set[fx.Node] = dataclasses.field(default_factory=set)

    def dim(self, node: Any) -> int | None:
        return _dim(self.env, node)

    def varies_along(self, node: fx.Node, dim: int) -> bool:
        """Whether the shared ``node`` has different entries along its ``dim``."""
        return _shape(node)[dim] != 1 and dim not in self.constant.get(node, ())

    def is_batch_index(self, node: Any) -> int | None:
        """The dim along which the shared ``node`` is ``arange(batch)``: each sample's own index."""
        if not isinstance(node, fx.Node) or node not in self.iota:
            return None
        dim = self.iota[node]
        return dim if _shape(node)[dim] == self.batch_size else None


_SAME_VALUES = {"clone", "alias", "detach", "_to_copy", "to", "contiguous", "type_as", "lift_fresh_copy"}


def _follow_shared(node: fx.Node, c: _Context) -> None:
    """Record what the shared ``node`` is constant along, and whether it is an ``arange``."""
    name, rank = _name(node), _val(node).dim()
    args = _tensor_args(node)
    source = args[0] if args else None
    constant: set[int] = set()
    iota = None
    if name in _FILL:
        constant = set(range(rank))
    elif name == "arange" and _arange_from_zero(node):
        iota = 0
    elif name in _SAME_VALUES or (name in ("add", "sub") and len(node.args) > 1 and node.args[1] == 0):
        constant, iota = set(c.constant.get(source, ())), c.iota.get(source)
    elif name == "unsqueeze":
        inserted = _norm(node.args[1], rank)
        constant = {d + (d >= inserted) for d in c.constant.get(source, ())} | {inserted}
        iota = None if source not in c.iota else c.iota[source] + (c.iota[source] >= inserted)
    elif name in ("expand", "expand_as"):
        offset = rank - len(_shape(source))
        constant = set(range(offset)) | {d + offset for d in c.constant.get(source, ())}
        constant |= {i + offset for i, (was, now) in enumerate(zip(_shape(source), _shape(node)[offset:]))
                     if was == 1 and now != 1}
        iota = None if source not in c.iota else c.iota[source] + offset
    elif name in ("slice", "narrow"):
        constant = set(c.constant.get(source, ()))
        along = _norm(_argument(node, "dim", 0), rank)
        iota = None if c.iota.get(source, along) == along else c.iota[source]
    elif name == "select":
        along = _norm(node.args[1], rank + 1)
        constant = {d - (d > along) for d in c.constant.get(source, ()) if d != along}
        iota = None if c.iota.get(source, along) == along else c.iota[source] - (c.iota[source] > along)
    elif name == "embedding":
        constant = set(c.constant.get(node.args[1], ()))
    elif name == "index":
        constant = _constant_after_index(node, c)
    elif name in ("triu", "tril"):  # a mask over the last two dims: the same along the others
        constant = {d for d in c.constant.get(source, ()) if d < rank - 2}
    elif name in ("cat", "concat", "concatenate", "stack"):  # the same along a dim every part is the same along
        parts = [t for t in node.args[0] if isinstance(t, fx.Node)]
        along = _norm(_argument(node, "dim", 0), rank)
        common = set.intersection(*(set(c.constant.get(t, ())) for t in parts)) if parts else set()
        if name != "stack":
            constant = common - {along}
        else:
            constant = {d + (d >= along) for d in common}
    elif name == "einsum":  # the same along a letter every operand having it is the same along
        equation = node.args[0].replace(" ", "")
        terms, _, output = equation.partition("->")
        if "." not in equation and output:
            constant = {i for i, letter in enumerate(output) if all(
                letter not in term or term.index(letter) in c.constant.get(operand, ())
                or _shape(operand)[term.index(letter)] == 1 for term, operand in zip(terms.split(","), node.args[1]))}
    elif name == "repeat":  # a size-1 dim tiled is the same along it (``position_ids.repeat(B, 1)``)
        offset = rank - len(_shape(source))
        constant = set(range(offset)) | {d + offset for d in range(len(_shape(source)))
                                         if _shape(source)[d] == 1 or d in c.constant.get(source, ())}
    elif name in _VIEWS:  # each dim that a view keeps whole (as many elements before it, as long)
        was, in_shape, out_shape = c.constant.get(source, ()), _shape(source), _shape(node)
        constant = {j for j, size in enumerate(out_shape) if any(
            i in was and in_shape[i] == size and math.prod(in_shape[:i]) == math.prod(out_shape[:j])
            for i in range(len(in_shape)))}
    elif name in ("linear", "mm", "addmm"):  # rows to rows: the same along the rows' dims it is the same along
        rows = node.args[1] if name == "addmm" else source
        constant = {d for d in c.constant.get(rows, ()) if d < rank - 1}
        bias = node.args[0] if name == "addmm" else _argument(node, "bias") if name == "linear" else None
        if isinstance(bias, fx.Node):  # added to every row: the same along a dim only where it is too
            offset = rank - len(_shape(bias))
            constant = {d for d in constant if d < offset or _shape(bias)[d - offset] == 1
                        or d - offset in c.constant.get(bias, ())}
    elif name in _TRANSPOSES | {"permute"}:  # each dim is one of the source's, moved
        constant = {d for d in range(rank) if _parent_dim(node, d, c) in c.constant.get(source, ())}
    elif _RULES.get(name) in (_along, _reduction) and _acted_dims(node) is not None:
        # a cumsum, diff or softmax along other dims (the mask helpers' running counts over positions),
        # a sum over others: still the same along the dims it is constant along
        acted = _acted_dims(node)
        constant = set.intersection(*(set(c.constant.get(arg, ())) if len(_shape(arg)) == len(_shape(source))
                                      else set() for arg in args)) - set(acted)  # (diff's prepend too)
        if _RULES[name] is _reduction and not _argument(node, "keepdim", False):
            constant = {d - sum(1 for a in acted if a < d) for d in constant}
    elif torch.Tag.pointwise in node.target.tags or name in _ENTRYWISE:
        constant = {d for d in range(rank) if all(
            d - (rank - len(_shape(arg))) < 0 or _shape(arg)[d - (rank - len(_shape(arg)))] == 1
            or d - (rank - len(_shape(arg))) in c.constant.get(arg, ()) for arg in args)}
    if constant:
        c.constant[node] = frozenset(constant)
    if iota is not None:
        c.iota[node] = iota
    tiled = _tiling(node, name, rank, source, c)
    if tiled:
        c.tiled[node] = tiled


def _tiling(node: fx.Node, name: str, rank: int, source: fx.Node | None, c: _Context) -> dict[int, int]:
    """The dims along which the shared ``node`` is a whole number of copies of a block, and how
    many (``alibi.repeat(B, 1, 1)``: a bias per head, the same for every sample of a [B*heads] dim)."""
    if name == "repeat":
        offset = rank - len(_shape(source))
        tiled = {d + offset: times for d, times in c.tiled.get(source, {}).items()}
        for d, times in enumerate(node.args[1]):
            tiled[d] = tiled.get(d, 1) * times
        return {d: times for d, times in tiled.items() if times > 1}
    if name in _SAME_VALUES:
        return dict(c.tiled.get(source, {}))
    return {}


def _constant_after_index(node: fx.Node, c: _Context) -> set[int]:
    """``x[i, j, ...]`` of shared values (``positions[arange(B)[:, None], kv]``, as the mask helpers
    look each sample's positions up): constant along a dim of the index tensors' broadcast where
    every index tensor for a dim ``x`` varies along is constant along it; the dims not indexed keep
    ``x``'s. The broadcast dims stand where the index tensors do when these are neighbours, first
    otherwise (advanced indexing's layout)."""
    source, indices = node.args[0], list(node.args[1])
    positions = [i for i, index in enumerate(indices) if index is not None]
    tensors = [indices[i] for i in positions]
    if not tensors or any(not isinstance(t, fx.Node) or _val(t).dtype == torch.bool for t in tensors):
        return set()
    was = c.constant.get(source, frozenset())
    rank = max(len(_shape(t)) for t in tensors)
    varying = [t for t, position in zip(tensors, positions) if position not in was]
    broadcast = {d for d in range(rank) if all(
        d - (rank - len(_shape(t))) < 0 or _shape(t)[d - (rank - len(_shape(t)))] == 1
        or d - (rank - len(_shape(t))) in c.constant.get(t, ()) for t in varying)}
    rest = [d for d in range(len(_shape(source))) if d not in positions]
    adjacent = positions == list(range(positions[0], positions[-1] + 1))
    start = positions[0] if adjacent else 0
    before = [d for d in rest if adjacent and d < start]
    after = [d for d in rest if d not in before]
    constant = {i for i, d in enumerate(before) if d in was} | {start + d for d in broadcast}
    constant |= {start + rank + i for i, d in enumerate(after) if d in was}
    return constant


# entry by entry, each result entry from the same entry of every argument, and not random (unlike
# dropout), yet without the pointwise tag on every overload (``where.ScalarOther``)
_ENTRYWISE = {"where", "masked_fill", "masked_fill_", "copy", "copy_", "__and__", "__or__", "__xor__", "__invert__",
              "floor_divide", "remainder", "fmod", "true_divide", "rsub", "copysign", "complex", "polar"}

# ``x.new_zeros(size)`` and the like: a fresh buffer, ``x`` only its dtype and device
_FRESH = {"new_zeros", "new_ones", "new_full", "new_empty", "new_empty_strided"}


def _written(node: fx.Node) -> fx.Node | None:
    """The tensor an in-place op (``copy_``, ``fill_``, ``masked_fill_``, ...) writes into: its first argument."""
    if not isinstance(node.target, torch._ops.OpOverload) or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    if node.target._schema.name.split("::")[-1] in _IN_PLACE_VIEWS:  # a new shape for the same values
        return None
    arguments = node.target._schema.arguments
    info = arguments[0].alias_info if arguments else None
    return node.args[0] if info is not None and info.is_write else None


# views that change their input's shape in place (``h.squeeze_(1)``; functorch's batching rules
# make them too): named as the view (its rule), and writing no value
_IN_PLACE_VIEWS = {"squeeze_", "unsqueeze_", "transpose_", "t_", "swapdims_", "swapaxes_"}


def _write(node: fx.Node, c: _Context) -> None:
    """An in-place op at ``node`` wrote its result into its first argument X, and so into the buffer X
    is a view of (``shifted[:, 1:] = ids[:, :-1]`` writes into ``shifted``): later readers of that
    buffer and of every view of it read the batch. Its batch dim is X's mapped back through the views,
    which may not cut or merge it; a buffer shared by every sample must be constant along it (the
    entries not written stay), and a parameter, buffer or input outlives the step."""
    (dim,) = c.env[node]
    chain = alias_chain(node.args[0])
    base = chain[-1]
    if any(c.outer.get(value, 1) > 1 for value in (node, *chain)):
        raise _mixed(node, "writes in place a batch interleaved with other dims; this analysis cannot follow it "
                           "back to its buffer")
    if dim is not None:
        for view in chain[:-1]:
            dim = _parent_dim(view, dim, c)
            if dim is None:
                raise _mixed(node, f"writes the batch into {view.name}, a view of {base.name} that holds only some "
                                   "of its entries along the batch dim (or merges the batch with another dim)")
    (was,) = c.env[base]
    if dim is None or was == dim:
        return
    if was is not None:
        raise _mixed(node, f"writes values batched along dim {dim} of {base.name}, which is batched along dim {was}")
    if base.op != "call_function":
        raise _mixed(node, f"writes the batch into {base.name}, a parameter, buffer or input every sample shares")
    if c.varies_along(base, dim):
        raise _mixed(node, f"writes the batch into {base.name}, which is shared by every sample but varies along the "
                           "batch dim")
    c.env[base] = [dim]
    _follow_views(base, c)


def _write_shared(node: fx.Node, c: _Context) -> None:
    """A shared value written in place: the buffer it lands in stays constant only along the dims the
    write covers whole with values constant along them, and is no longer an ``arange``."""
    chain = alias_chain(node.args[0])
    base = chain[-1]
    constant = set(c.constant.get(node, ()))
    for view in chain[:-1]:
        if _name(view) not in ("slice", "narrow", "select", "alias", "detach", "transpose", "t", "permute",
                               "unsqueeze") and _written(view) is None:
            constant = set()  # a view not followed back here: nothing is known to stay constant
        constant = {p for p in (_parent_dim(view, d, c) for d in constant) if p is not None}
    constant &= c.constant.get(base, frozenset())
    c.constant.pop(base, None)
    c.iota.pop(base, None)
    if constant:
        c.constant[base] = frozenset(constant)
    _follow_views(base, c)


def _follow_views(base: fx.Node, c: _Context) -> None:
    """The views of ``base`` seen so far (and in-place ops' results, which are their argument) see its
    new values: run their rules again, parents first."""
    queue = [base]
    while queue:
        parent = queue.pop(0)
        for view in parent.users:
            if view not in c.env or view.args[0] is not parent or aliased(view) is None:
                continue
            c.constant.pop(view, None)
            c.iota.pop(view, None)
            if _written(view) is not None:  # the buffer it wrote into, as it is now
                c.env[view] = list(c.env[parent])
                if parent in c.constant:
                    c.constant[view] = c.constant[parent]
                if parent in c.iota:
                    c.iota[view] = c.iota[parent]
            elif any(d is not None for d in c.env[parent]):
                c.env[view] = _apply(view, c)
            elif isinstance(_val(view), torch.Tensor) and view.target is not operator.getitem:
                _follow_shared(view, c)  # (a split's pieces: nothing known to stay constant)
            queue.append(view)


def _parent_dim(view: fx.Node, dim: int, c: _Context) -> int | None:
    """The dim of the tensor ``view`` views that is ``view``'s ``dim``; None where the view holds only
    some of the entries along it."""
    if not isinstance(view.target, torch._ops.OpOverload) or not isinstance(_val(view), torch.Tensor):
        raise _mixed(view, "is a piece of a split tensor written in place; this analysis cannot follow the write "
                           "back to the whole")
    parent = view.args[0]
    name, in_shape, out_shape = _name(view), _shape(parent), _shape(view)
    if _written(view) is not None or (in_shape == out_shape and name in _SAME_VALUES | _VIEWS | {"expand"}):
        return dim
    if name in ("slice", "narrow"):
        along = _norm(_argument(view, "dim", 0), len(in_shape))
        return None if along == dim and in_shape[dim] != out_shape[dim] else dim
    if name == "select":
        return dim + (dim >= _norm(view.args[1], len(in_shape)))
    if name in _TRANSPOSES:
        first, second = _swapped(view, len(in_shape))
        return second if dim == first else first if dim == second else dim
    if name == "permute":
        return [_norm(d, len(in_shape)) for d in view.args[1]][dim]
    if name == "unsqueeze":
        inserted = _norm(view.args[1], len(out_shape))
        return None if dim == inserted else dim - (dim > inserted)
    if name in _VIEWS:  # as ``_reshape`` maps it forward: the dim starting at the same offset
        before = math.prod(out_shape[:dim])
        return next((index for index, size in enumerate(in_shape)
                     if math.prod(in_shape[:index]) == before and size % c.batch_size == 0), None)
    raise _mixed(view, "is a view written into in place that this analysis cannot follow back to its buffer")


_VIEWS = {"view", "_unsafe_view", "reshape", "flatten", "unflatten", "squeeze", "view_as", "_reshape_alias", "ravel",
          "reshape_as"}


def _arange_from_zero(node: fx.Node) -> bool:
    start, step = 0, 1
    if node.target is aten.arange.start or node.target is aten.arange.start_step:
        start = node.args[0]
        step = node.args[2] if len(node.args) > 2 else node.kwargs.get("step", 1)
    return start == 0 and step == 1


_FILL = {"zeros", "ones", "full", "empty", "empty_strided", "new_zeros", "new_ones", "new_full", "new_empty",
         "zeros_like", "ones_like", "full_like", "empty_like", "scalar_tensor", "fill", "fill_", "zero_", "zero"}


def _name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        name = target._schema.name.split("::")[-1]
        return name[:-1] if name in _IN_PLACE_VIEWS else name
    return getattr(target, "__name__", str(target))


# ----------------------------------------------------------------------------------- the rules


def _apply(node: fx.Node, c: _Context) -> _Dims:
    """The node's rule (the sort's, where a value made from a sort of the batch comes in), and
    where its batched inputs' batch is interleaved, whether the rule keeps each sample's rows
    apart (then its batched results are interleaved alike)."""
    c.outer.pop(node, None)  # a view run again after a write (``_follow_views``) starts afresh
    if any(arg in c.sorted for arg in node.all_input_nodes) or _sorts_the_batch(node, c):
        return _through_sorted(node, c)
    batched = [arg for arg in _tensor_args(node) if c.dim(arg) not in (None, _REDUCED)] \
        if node.target is not operator.getitem else [node.args[0]]
    outers = {c.outer.get(arg, 1) for arg in batched}
    dims = _rule(node, c)
    if outers <= {1} or _name(node) in _VIEWS:  # a reshape decides its own (``_reshape``)
        return dims
    if len(outers) > 1:
        raise _mixed(node, "combines batches interleaved differently with other dims")
    if not _keeps_rows(node):
        raise _mixed(node, "meets a batch interleaved with other dims (a reshape merged it with an outer dim); "
                           "this analysis can follow it only through ops that treat the rows of that dim apart")
    (outer,) = outers
    rows = {_shape(arg)[c.dim(arg)] for arg in batched}
    values = leaves(_val(node))
    for dim, value in zip(dims, values):
        if isinstance(dim, int) and (not isinstance(value, torch.Tensor) or value.shape[dim] not in rows):
            raise _mixed(node, "changes the rows of a batch interleaved with other dims")
    c.outer[node] = outer
    return dims


# ----------------------------------------------------------------------- tokens sorted by expert
# A mixture of experts' grouped matmuls (transformers' ``grouped_mm`` experts) sort every
# (token, expert) pair of the batch by expert id, multiply each expert's run of rows by its
# weights (``offsets``: the cumulative count of each id), and put the rows back in their order:
#
#     ids, perm = sort(expert_ids)            rows = hidden[perm // top_k]    w = weights[perm]
#     offsets = cumsum(histc(ids, bins=E, min=0, max=E - 1))
#     out = grouped_mm(rows, W, offsets) * w  inverse[perm] = arange(N)     out[inverse]
#
# Each row's result is its own pair's (the row's group is its own id, as the ids are sorted and the
# offsets count each id), so cutting the batch computes what the whole batch does. Followed here
# as exactly that: each value made from the sort is one of the kinds below, tied to its sort; a
# row-wise op keeps rows sorted; anything else, or a model output, meeting one stops the analysis.
_KEYS, _ROWS, _PERM, _PERM_DIV, _FRESH_FOR, _INVERSE, _COUNTS, _OFFSETS = (
    "keys", "rows", "perm", "perm // top_k", "fresh", "inverse", "counts", "offsets")

_GROUPED_MM = {"_grouped_mm", "grouped_mm", "grouped_mm_fallback"}


def _sorts_the_batch(node: fx.Node, c: _Context) -> bool:
    """``sort`` of a 1-d value batched along its dim 0 (the batch its outer factor), ascending."""
    if _name(node) != "sort" or not isinstance(node.args[0], fx.Node) or node.args[0] in c.sorted:
        return False
    source = node.args[0]
    return (len(_shape(source)) == 1 and c.dim(source) == 0 and source not in c.outer
            and not _argument(node, "descending", False))


def _through_sorted(node: fx.Node, c: _Context) -> _Dims:
    """The rules for values made from a sort of the batch (the block comment above)."""
    kinds = {arg: c.sorted[arg] for arg in node.all_input_nodes if arg in c.sorted}
    sorts = {sort for _, sort in kinds.values()}
    if len(sorts) > 1:
        raise _mixed(node, "combines tokens sorted by different sorts")
    sort = next(iter(sorts), node)
    rows = _shape(sort.args[0])[0]
    name = _name(node)

    def made(kind: str, dims: _Dims | None = None) -> _Dims:
        c.sorted[node] = (kind, sort)
        return dims or [0]

    if node is sort:
        return made("sort", [0, 0])
    if node.target is operator.getitem and node.args[0] is sort:
        return made(_KEYS if node.args[1] == 0 else _PERM)
    kind = {arg: k for arg, (k, _) in kinds.items()}
    first = node.args[0] if node.args else None
    if name in _SAME_VALUES and kind.get(first) == _KEYS:  # the ids cast for histc
        return made(_KEYS)
    if name == "floor_divide" and kind.get(first) == _PERM and isinstance(node.args[1], int) \
            and (rows // c.batch_size) % node.args[1] == 0:  # a sample's pairs: whole tokens of it
        return made(_PERM_DIV)  # each sorted pair's token, the pairs made from [tokens, top_k]
    if name == "index" and len(node.args[1]) == 1 and isinstance(node.args[1][0], fx.Node):
        looked_up = _sorted_lookup(node, kind, rows, c)
        return made(looked_up) if looked_up else [0]
    if name in _FRESH_LIKE and kind.get(first) == _PERM:
        return made(_FRESH_FOR)
    if name in ("index_put", "index_put_") and kind.get(first) == _FRESH_FOR and len(node.args[1]) == 1 \
            and kind.get(node.args[1][0]) == _PERM and c.iota.get(node.args[2]) == 0 \
            and _shape(node.args[2]) == (rows,):
        c.sorted[first] = (_INVERSE, sort)  # written whole, every position once: perm is a permutation
        return made(_INVERSE)
    if name == "histc" and kind.get(first) == _KEYS and _argument(node, "min") == 0 \
            and _argument(node, "max") == _argument(node, "bins") - 1:  # one bin per id: the count of each
        return made(_COUNTS, [None])
    if name == "cumsum" and kind.get(first) == _COUNTS:
        return made(_OFFSETS, [None])
    if name in _GROUPED_MM and kind.get(first) in (_ROWS, _KEYS) and kind.get(_argument(node, "offs")) == _OFFSETS \
            and all(c.dim(arg) is None for arg in _tensor_args(node) if arg not in kinds):
        return made(_ROWS)  # row r by the weights of group r's id: its own id
    if all(k in (_ROWS, _KEYS) for k in kind.values()) and not any(
            c.dim(arg) is not None and arg not in kinds for arg in _tensor_args(node)) and _keeps_rows(node):
        dims = _rule(node, c)  # row-wise: each result row from the same rows, whatever their order
        values = leaves(_val(node))
        if all(d is None or (d == 0 and v.shape[0] == rows) for d, v in zip(dims, values)):
            return made(_ROWS, dims)
    raise _mixed(node, f"meets the batch's rows sorted by {sort.name} ({kind.get(first, 'a value made from them')}) "
                       "in a way this analysis cannot follow")


def _sorted_lookup(node: fx.Node, kind: Mapping[fx.Node, str], rows: int, c: _Context) -> str | None:
    """``x[i]`` with one index tensor, about a sort: the batch's pairs (or their tokens) put in
    sorted order, or a shared table looked up by sorted ids (both sorted rows); or sorted rows put
    back by the inverse permutation (``None``: the batch's rows, in its order, along dim 0)."""
    source, (index,) = node.args[0], node.args[1]
    in_order = c.dim(source) == 0 and source not in c.outer and source not in kind
    if kind.get(index) == _PERM and in_order and _shape(source)[0] == rows:
        return _ROWS
    if kind.get(index) == _PERM_DIV and in_order and _shape(source)[0] * index.args[1] == rows:
        return _ROWS
    if kind.get(index) in (_KEYS, _ROWS) and c.dim(source) is None:
        return _ROWS
    if kind.get(index) == _INVERSE and kind.get(source) in (_ROWS, _KEYS) and _shape(source)[0] == rows:
        return None
    raise _mixed(node, "looks the batch's sorted rows up in a way this analysis cannot follow")


_FRESH_LIKE = {"empty_like", "zeros_like", "new_empty", "new_zeros"}


def _keeps_rows(node: fx.Node) -> bool:
    """Whether the node's rule, where it accepts a batch dim, computes each row of that dim from the
    same row of its inputs: then a batch interleaved in that dim stays so."""
    if node.target is operator.getitem:
        return True
    if not isinstance(node.target, torch._ops.OpOverload):
        return False
    rule = _RULES.get(_name(node))
    if rule is None:
        return torch.Tag.pointwise in node.target.tags or _name(node) in _ELEMENTWISE
    return rule in _ROW_WISE


def _rule(node: fx.Node, c: _Context) -> _Dims:
    target = node.target
    if target is operator.getitem:
        source, index = node.args
        if not isinstance(index, int) or len(c.env[source]) <= index:
            raise _mixed(node, "takes an item of a batched value this analysis cannot follow")
        return [c.env[source][index]]
    if isinstance(target, torch._ops.HigherOrderOperator):
        return _subgraph(node, c)
    if not isinstance(target, torch._ops.OpOverload):
        raise _mixed(node, "is not an ATen op; the batch cannot be followed through it")
    name = _name(node)
    # by name, but an entrywise overload is entrywise (torch.max(a, b) is max.other, not a reduction)
    rule = None if torch.Tag.pointwise in target.tags else _RULES.get(name)
    if (rule is None and torch.Tag.dynamic_output_shape in target.tags) or (name == "where" and len(node.args) == 1):
        # nonzero, torch.where(mask) with one argument (nonzero as a tuple), unique: as many results
        # as the batch's values say, each from whichever sample holds it
        raise _mixed(node, "lists entries the batch's values pick (torch.where(mask), nonzero, unique): how many, "
                           "and from which samples, depends on them")
    if rule is not None:
        return rule(node, c)
    if torch.Tag.pointwise in target.tags or name in _ELEMENTWISE:
        return [_broadcast(node, _tensor_args(node), c)]
    return _decomposed(node, c)


def _decomposed(node: fx.Node, c: _Context) -> _Dims:
    """An op with no rule that torch defines by other ops (a CompositeImplicitAutograd kernel, which
    export keeps whole: ``cosine_similarity``, ``pairwise_distance``, ``outer``, ``mv``,
    ``tensordot``, ``take_along_dim``, ``bilinear``, ...): traced into those ops on fakes, as its
    kernel computes, and read by these rules."""
    graph = _decomposition(node)
    if graph is None:
        raise _mixed(node, "has no rule saying how it treats the batch dim")
    tensors = [arg for arg in pytree.tree_leaves((node.args, node.kwargs), is_leaf=lambda x: isinstance(x, fx.Node))
               if isinstance(arg, fx.Node)]
    inner = {p.name: list(c.env[t]) for p, t in zip(graph.graph.find_nodes(op="placeholder"), tensors)}
    try:
        inner_env, inner_c = _propagate(graph, inner, c.batch_size)
    except _Mixed as mixed:
        raise _mixed(node, f"mixes the samples in the ops it is made of: {mixed}") from mixed
    results = leaves(graph.graph.find_nodes(op="output")[0].args[0])
    if any(isinstance(r, fx.Node) and (r in inner_c.outer or r in inner_c.sorted) for r in results):
        raise _mixed(node, "returns the batch interleaved or sorted by the ops it is made of")
    return [inner_env[r][0] if isinstance(r, fx.Node) else None for r in results]


_DECOMPOSITIONS: dict[tuple, fx.GraphModule | None] = {}


def _decomposition(node: fx.Node) -> fx.GraphModule | None:
    """``node``'s op as the ATen ops its CompositeImplicitAutograd kernel runs, traced on fakes of
    its arguments' shapes (``None``: it has none, or it reads values); traced once per op and shapes."""
    from torch.fx.experimental.proxy_tensor import make_fx

    target = node.target
    if not torch._C._dispatch_has_kernel_for_dispatch_key(target.name(), "CompositeImplicitAutograd"):
        return None
    flat, spec = pytree.tree_flatten((node.args, node.kwargs), is_leaf=lambda x: isinstance(x, fx.Node))
    positions = [i for i, arg in enumerate(flat) if isinstance(arg, fx.Node)]
    if not all(isinstance(_val(flat[i]), torch.Tensor) for i in positions):
        return None
    key = (target, spec, tuple(None if i in positions else repr(a) for i, a in enumerate(flat)),
           tuple((tuple(_val(flat[i]).shape), tuple(_val(flat[i]).stride()), _val(flat[i]).dtype) for i in positions))
    if key not in _DECOMPOSITIONS:
        def run(*tensors):
            given = list(flat)
            for i, tensor in zip(positions, tensors):
                given[i] = tensor
            args, kwargs = pytree.tree_unflatten(given, spec)
            return target.decompose(*args, **kwargs)

        examples = [torch.empty_strided(_val(flat[i]).shape, _val(flat[i]).stride(), dtype=_val(flat[i]).dtype,
                                        device="meta") for i in positions]
        if len(_DECOMPOSITIONS) >= 256:  # the shapes of many models in one process: bounded
            _DECOMPOSITIONS.clear()
        try:
            _DECOMPOSITIONS[key] = make_fx(run, tracing_mode="fake")(*examples)
        except Exception:  # noqa: BLE001 - a kernel that reads values, or cannot run on fakes: no rule
            _DECOMPOSITIONS[key] = None
    return _DECOMPOSITIONS[key]


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    return [arg for arg in node.all_input_nodes if isinstance(_val(arg), torch.Tensor)]


def _broadcast(node: fx.Node, args: Sequence[fx.Node], c: _Context, out_shape: Sequence[int] | None = None,
               dim: int | None = None) -> int:
    """The batch dim of the broadcast of ``args`` (shaped ``out_shape``, by default the node's own;
    ``dim``: the batch dim the result already has): every batched argument must agree on it, and a
    shared argument must be constant along it."""
    rank = len(_shape(node) if out_shape is None else out_shape)
    found = dim
    for arg in args:
        dim = c.dim(arg)
        if dim is not None:
            aligned = dim + rank - len(_shape(arg))
            if found is not None and found != aligned:
                raise _mixed(node, "combines values batched along different dims")
            found = aligned
    interleaved = any(arg in c.outer for arg in args)
    for arg in args:
        if c.dim(arg) is None:
            position = found - (rank - len(_shape(arg)))
            # a block per sample's rows (copies by a multiple of the batch, the batch the dim's outer factor)
            per_sample = not interleaved and c.tiled.get(arg, {}).get(position, 1) % c.batch_size == 0
            if 0 <= position and c.varies_along(arg, position) and not per_sample:
                raise _mixed(node, f"combines the batch with {arg.name}, which is shared by every sample but varies "
                                   "along the batch dim")
    return found


def _first_dim(node: fx.Node, c: _Context) -> int:
    return c.dim(node.args[0])


def _reshape(node: fx.Node, c: _Context) -> _Dims:
    """A view or reshape. The samples stay apart if the output has a dim with as many elements
    before it as the batch dim had, and the batch is an outer factor of it (each sample then
    fills whole rows of it): ``[B, S, H] -> [B*S, H]`` keeps the batch at dim 0, ``[S, B, H] ->
    [S*B, H]`` interleaves it."""
    source = node.args[0]
    dim = c.dim(source)
    in_shape, out_shape = _shape(source), _shape(node)
    # the elements' flat index is [above, batch, below] in mixed radix: the batch lands in the output
    # dim that spans it whole, interleaved where that dim also spans some of ``above``
    above = math.prod(in_shape[:dim]) * c.outer.get(source, 1)
    for index, size in enumerate(out_shape):
        spans = math.prod(out_shape[:index])
        if spans and above % spans == 0 and (spans * size) % (above * c.batch_size) == 0:
            if above > spans:
                c.outer[node] = above // spans
            return [index]
    raise _mixed(node, f"reshapes {in_shape} to {out_shape}, cutting the batch (dim {dim}) across dims")


def _broadcast_tensors(node: fx.Node, c: _Context) -> _Dims:
    """Each tensor expanded to the shape of all (``mse_loss`` broadcasts its input and target so):
    every result batched along the broadcast's batch dim, where any argument is batched."""
    args = _tensor_args(node)
    found = _broadcast(node, args, c, torch.broadcast_shapes(*[_shape(a) for a in args]))
    return [found] * len(leaves(_val(node)))


def _expand(node: fx.Node, c: _Context) -> _Dims:
    source = node.args[0]
    aligned = c.dim(source) + len(_shape(node)) - len(_shape(source))
    return [aligned]


_TRANSPOSES = {"transpose", "t", "swapaxes", "swapdims", "mT", "mH", "adjoint"}


def _swapped(node: fx.Node, rank: int) -> tuple[int, int]:
    """The two dims a transpose swaps: ``t()`` of a vector none, ``x.mT`` (``q @ k.mT``) the last two."""
    name = _name(node)
    if rank < 2:
        return 0, 0
    if name == "t":
        return 0, 1
    if name in ("mT", "mH", "adjoint"):
        return rank - 2, rank - 1
    return _norm(node.args[1], rank), _norm(node.args[2], rank)


def _transpose(node: fx.Node, c: _Context) -> _Dims:
    dim = _first_dim(node, c)
    first, second = _swapped(node, len(_shape(node.args[0])))
    return [second if dim == first else first if dim == second else dim]


def _permute(node: fx.Node, c: _Context) -> _Dims:
    rank = len(_shape(node.args[0]))
    return [[_norm(d, rank) for d in node.args[1]].index(_first_dim(node, c))]


def _unsqueeze(node: fx.Node, c: _Context) -> _Dims:
    dim = _first_dim(node, c)
    return [dim + 1 if _norm(node.args[1], len(_shape(node))) <= dim else dim]


def _unchanged_leading(node: fx.Node, c: _Context) -> _Dims:
    """An op that changes only the last dim (``view_as_real`` adds one, ``view_as_complex`` removes it)."""
    dim = _first_dim(node, c)
    if dim >= min(len(_shape(node.args[0])), len(_shape(node))) - 1:
        raise _mixed(node, "changes the batch dim (the last)")
    return [dim]


def _entrywise_then_new_dims(node: fx.Node, c: _Context) -> _Dims:
    """An op on each entry of its first argument that may add dims after the others (``one_hot``'s
    classes; ``bucketize``'s boundaries, which must be the same for every sample)."""
    if any(c.dim(arg) is not None for arg in _tensor_args(node)[1:]):
        raise _mixed(node, "takes a second tensor batched along the batch dim")
    return [_first_dim(node, c)]


def _per_leading_sample(node: fx.Node, c: _Context) -> _Dims:
    """An op that makes each sample's result from that sample's slice along dim 0 alone
    (``affine_grid``: a grid per theta)."""
    if _first_dim(node, c) != 0:
        raise _mixed(node, "is batched along another dim than its first")
    return [0]


def _argument(node: fx.Node, name: str, default: Any = None) -> Any:
    """The ATen op's argument ``name`` at ``node``: given, or its schema default."""
    for index, argument in enumerate(node.target._schema.arguments):
        if argument.name == name:
            if index < len(node.args):
                return node.args[index]
            if name in node.kwargs:
                return node.kwargs[name]
            return argument.default_value if argument.has_default_value() else default
    return default


def _acted_dims(node: fx.Node) -> list[int] | None:
    """The dims an op acts along (its ``dim`` argument, ``dims`` for ``flip`` and ``roll``),
    normalised; ``None``: every dim."""
    names = [argument.name for argument in node.target._schema.arguments]
    value = _argument(node, "dim" if "dim" in names else "dims")
    rank = len(_shape(node.args[0]))
    if value is None or value == []:
        return None
    return [_norm(d, rank) for d in ([value] if isinstance(value, int) else value)]


def _reduction(node: fx.Node, c: _Context) -> _Dims:
    """sum/mean/amax/var/...: along some dims (keepdim or not). Over the batch it mixes samples,
    unless it is a sum or mean down to a scalar: a loss, for an output."""
    dim, acted = _first_dim(node, c), _acted_dims(node)
    if acted is None or dim in acted:
        if _name(node) in ("sum", "mean") and _val(node).dim() == 0:
            return [_REDUCED]
        raise _mixed(node, "reduces along the batch dim")
    kept = dim if _argument(node, "keepdim", False) else dim - sum(1 for d in acted if d < dim)
    return [kept] * len(leaves(_val(node)))


def _along(node: fx.Node, c: _Context) -> _Dims:
    """softmax, cumsum, sort, glu, kthvalue, ...: along ``dim``; never the batch dim. An op that
    drops the dims it acts along (kthvalue with keepdim=False) moves the batch dim down past them."""
    dim, acted = _first_dim(node, c), _acted_dims(node)
    if acted is None or dim in acted:
        raise _mixed(node, "acts along the batch dim")
    if leaves(_val(node))[0].dim() < len(_shape(node.args[0])):
        dim -= sum(1 for d in acted if d < dim)
    return [dim] * len(leaves(_val(node)))


def _select(node: fx.Node, c: _Context) -> _Dims:
    """select / index_select / slice / narrow: some of the entries along ``dim``."""
    dim, (along,) = _first_dim(node, c), _acted_dims(node) or [0]
    removes = _name(node) == "select"
    if along == dim and (removes or _shape(node)[dim] != _shape(node.args[0])[dim]):
        raise _mixed(node, "picks some samples of the batch")
    if along == dim and _name(node) == "index_select" and c.is_batch_index(node.args[2]) != 0:
        # as many rows as the batch, but which: a permutation or a flip mixes the samples
        raise _mixed(node, "picks the batch's samples by an index other than each sample's own")
    return [dim - 1 if removes and along < dim else dim]


def _unfold(node: fx.Node, c: _Context) -> _Dims:
    """``Tensor.unfold(dimension, size, step)``: windows along ``dimension`` (a patch of an image, a
    frame of a signal), each window's entries in a new last dim; never along the batch dim."""
    dim = _first_dim(node, c)
    if _norm(node.args[1], len(_shape(node.args[0]))) == dim:
        raise _mixed(node, "cuts windows along the batch dim")
    return [dim]


def _split(node: fx.Node, c: _Context) -> _Dims:
    dim, (along,) = _first_dim(node, c), _acted_dims(node) or [0]
    if along == dim:
        raise _mixed(node, "splits the batch")
    removes = _name(node) == "unbind"
    return [dim - 1 if removes and along < dim else dim] * len(leaves(_val(node)))


def _cat(node: fx.Node, c: _Context) -> _Dims:
    # a 1-D empty tensor is no part at all (torch.cat skips it): a key/value cache's first keys
    tensors = [t for t in node.args[0] if isinstance(t, fx.Node) and not (_name(node) != "stack" and _shape(t) == (0,))]
    along = _norm(_argument(node, "dim", 0), len(_shape(node)))
    dims = {c.dim(t) for t in tensors} - {None}
    if len(dims) != 1:
        raise _mixed(node, "joins values batched along different dims")
    (dim,) = dims
    for t in tensors:
        if c.dim(t) is None and c.varies_along(t, dim):
            raise _mixed(node, f"joins the batch with {t.name}, which every sample shares")
    if _name(node) == "stack":
        return [dim + 1 if along <= dim else dim]
    if along == dim:
        raise _mixed(node, "joins along the batch dim")
    return [dim]


def _index(node: fx.Node, c: _Context) -> _Dims:
    """``x[i, j, ...]`` with index tensors (``aten.index.Tensor``). The samples stay apart when the
    batch dim is not indexed (and the index tensors are shared, after it), or when it is indexed by
    ``arange(B)``, each sample's own index, against which the other index tensors line up."""
    source, indices = node.args[0], list(node.args[1])
    dim = c.dim(source)
    positions = [i for i, index in enumerate(indices) if index is not None]
    tensors = [indices[i] for i in positions]
    if dim is None:
        if len(indices) == 1 and c.dim(indices[0]) is not None:  # a shared table looked up per sample
            return [c.dim(indices[0])]
        raise _mixed(node, "indexes with batched indices this analysis cannot follow")
    adjacent = positions == list(range(positions[0], positions[-1] + 1))
    if dim not in positions:
        if any(c.dim(t) is not None for t in tensors) or not adjacent or positions[0] < dim:
            raise _mixed(node, "indexes with tensors in a way this analysis cannot follow")
        return [dim]
    # the batch dim is indexed: only by arange(B), with the index tensors broadcast together
    rank = max(len(_shape(t)) for t in tensors)
    batch_index = c.is_batch_index(indices[dim])
    index = indices[dim]
    if batch_index is None and isinstance(index, fx.Node) and index in c.iota and \
            _shape(index)[c.iota[index]] == _shape(source)[dim] and c.outer.get(source, 1) == 1:
        # arange over the whole dim the batch is merged into, as its outer factor: the identity
        batch_index = c.iota[index]
        c.full_ranges.add(index)
    if batch_index is None:
        raise _mixed(node, "indexes the batch dim")
    found = batch_index + rank - len(_shape(indices[dim]))
    for t in tensors:
        if t is indices[dim]:
            continue
        if c.dim(t) is not None:
            if c.dim(t) + rank - len(_shape(t)) != found:
                raise _mixed(node, "indexes with tensors batched along another dim")
        elif found - (rank - len(_shape(t))) >= 0 and c.varies_along(t, found - (rank - len(_shape(t)))):
            raise _mixed(node, f"indexes with {t.name}, which differs from sample to sample")
    return [found + (positions[0] if adjacent else 0)]


def _gather(node: fx.Node, c: _Context) -> _Dims:
    """``out[b][j] = x[b][index[b][j]]`` along another dim than the batch's: from the sample's own
    row of a batched ``x``, or of a shared ``x`` that is the same for every sample (a buffer
    ``expand``ed to the batch, as RoBERTa gathers its token types by position)."""
    source, index = node.args[0], _argument(node, "index")
    (along,) = _acted_dims(node)
    dim = c.dim(index)
    if dim is None or along == dim or c.dim(source) not in (dim, None):
        raise _mixed(node, "gathers across the batch")
    if c.dim(source) is None and c.varies_along(source, dim):
        raise _mixed(node, f"gathers from {source.name}, which every sample shares but varies along the batch dim")
    return [dim]


def _scatter(node: fx.Node, c: _Context) -> _Dims:
    """``scatter``/``scatter_add``/``scatter_reduce`` along another dim than the batch's
    (``full_like(logits, -inf).scatter_(1, top_k, values)``, a router's scores): each sample's row
    written from its own index and source rows, all as long as the result along the batch dim."""
    (along,) = _acted_dims(node)
    dim = _broadcast(node, _tensor_args(node), c)
    if along == dim:
        raise _mixed(node, "scatters along the batch dim")
    if any(len(_shape(arg)) != len(_shape(node)) or _shape(arg)[dim] != _shape(node)[dim]
           for arg in _tensor_args(node)):
        raise _mixed(node, "scatters with an index or source that covers only some of the batch")
    return [dim]


def _repeat(node: fx.Node, c: _Context) -> _Dims:
    """``x.repeat(sizes)``: the batch dim kept where it is not repeated; repeated r times, the
    batch is interleaved in it below r blocks (``hidden.repeat(experts, 1)``, Llama 4's experts)."""
    offset = len(_shape(node)) - len(_shape(node.args[0]))
    dim = _first_dim(node, c) + offset
    times = node.args[1][dim]
    if times != 1:
        if node.args[0] in c.outer:
            raise _mixed(node, "repeats a batch already interleaved with other dims")
        c.outer[node] = times
    return [dim]


def _einsum(node: fx.Node, c: _Context) -> _Dims:
    """``einsum(equation, operands)``: the batch dim's letter must be the same in every batched
    operand, kept in the result (not summed over), and absent from the shared operands (or on a
    dim they are the same along)."""
    equation, operands = node.args[0].replace(" ", ""), list(node.args[1])
    inputs, _, output = equation.partition("->")
    terms = inputs.split(",")
    if "." in equation or not output or len(terms) != len(operands):
        raise _mixed(node, f"is an einsum ({equation}) this analysis does not read (an ellipsis or no explicit output)")
    letters = {terms[i][c.dim(operand)] for i, operand in enumerate(operands) if c.dim(operand) is not None}
    if len(letters) != 1:
        raise _mixed(node, f"multiplies values batched along different dims ({equation})")
    (letter,) = letters
    if letter not in output:
        raise _mixed(node, f"sums over the batch dim ({equation})")
    for term, operand in zip(terms, operands):
        if c.dim(operand) is None and letter in term and c.varies_along(operand, term.index(letter)):
            raise _mixed(node, f"multiplies the batch by {operand.name}, which every sample shares but varies along "
                               "the batch dim")
    return [output.index(letter)]


def _embedding(node: fx.Node, c: _Context) -> _Dims:
    weight, indices = node.args[:2]
    if c.dim(weight) is not None:
        raise _mixed(node, "looks up a batched table")
    if _argument(node, "scale_grad_by_freq"):
        raise _mixed(node, "scales each row's gradient by how often the batch looks it up (scale_grad_by_freq)")
    return [c.dim(indices)]


def _embedding_bag(node: fx.Node, c: _Context) -> _Dims:
    """``nn.EmbeddingBag`` on a ``[B, L]`` input: torch flattens the indices and bags every ``L`` of
    them (offsets ``arange(0, B * L, L)``), so bag ``b`` is sample ``b``'s row and the output's dim 0
    is the batch's. Bags the caller delimits with offsets over one flat list of indices, or indices
    not cut along their dim 0, are left to the rule's refusal (the microbatches' offsets would be
    the whole batch's)."""
    weight, indices, offsets = node.args[:3]
    if c.dim(weight) is not None:
        raise _mixed(node, "looks up a batched table")
    if _argument(node, "scale_grad_by_freq"):
        raise _mixed(node, "scales each row's gradient by how often the batch looks it up (scale_grad_by_freq)")
    weights = _argument(node, "per_sample_weights")
    for values in (indices, weights) if isinstance(weights, fx.Node) else (indices,):
        shared_per_sample = values is weights and c.dim(values) is None and (
            not c.varies_along(values, 0) or c.tiled.get(values, {}).get(0, 1) % c.batch_size == 0)
        if not shared_per_sample and (c.dim(values) != 0 or values in c.outer):
            raise _mixed(node, f"bags {values.name}, whose dim 0 is not the batch's samples one after another")
    rows = _shape(indices)[0]
    last = [rows] if _argument(node, "include_last_offset") else []
    one_bag_a_sample = list(range(0, rows, rows // c.batch_size)) + last
    if c.dim(offsets) is not None or offsets.target is not aten.arange.start_step \
            or list(range(*offsets.args[:3])) != one_bag_a_sample:
        raise _mixed(node, "bags the batch's indices by offsets other than one bag per sample")
    for user in node.users:  # offset2bag, bag_size, max_indices: read by its backward only
        if user.target is operator.getitem and user.args[1] > 0 and user.users:
            raise _mixed(node, "has its bookkeeping outputs (offset2bag, bag_size, max_indices) read")
    return [0] + [None] * (len(leaves(_val(node))) - 1)


def _matmul(node: fx.Node, c: _Context) -> _Dims:
    """``a @ b`` (``mm``, ``bmm``, ``matmul``, ``linear``, ``addmm``, ``baddbmm``): a batch dim in
    the broadcast dims or the rows (columns) kept; never a contracted one."""
    name = _name(node)
    if name in ("addmm", "baddbmm"):
        bias, a, b = node.args[:3]
    elif name == "linear":
        a, b, bias = node.args[0], node.args[1], _argument(node, "bias")
    else:
        (a, b), bias = node.args[:2], None
    rank = len(_shape(node))
    found = set()
    dim_a, rank_a = c.dim(a), len(_shape(a))
    dim_b, rank_b = c.dim(b), len(_shape(b))
    if dim_a is not None:
        if rank_a == 1 or dim_a == rank_a - 1:
            raise _mixed(node, "contracts the batch dim")
        # by a vector (``h @ v``: a's dims but its last), else a's rows and broadcast dims aligned right
        found.add(dim_a if rank_b == 1 else dim_a + rank - rank_a)
    if dim_b is not None:
        if name == "linear" or rank_b == 1 or dim_b == rank_b - 2:
            raise _mixed(node, "contracts the batch dim (or multiplies by a batched weight)")
        if rank_a == 1:  # a vector by b: b's dims but its rows
            found.add(dim_b if dim_b < rank_b - 2 else dim_b - 1)
        else:
            found.add(rank - 1 if dim_b == rank_b - 1 else dim_b + rank - rank_b)
    if len(found) != 1:
        raise _mixed(node, "multiplies values batched along different dims")
    (dim,) = found
    if isinstance(bias, fx.Node):
        _broadcast(node, [bias], c, dim=dim)
    return [dim]


def _convolution(node: fx.Node, c: _Context) -> _Dims:
    x, weight = node.args[:2]
    if c.dim(weight) is not None:
        raise _mixed(node, "convolves with a batched weight")
    if len(_shape(x)) != len(_shape(weight)) or c.dim(x) != 0:
        raise _mixed(node, "convolves an input whose batch dim is not its dim 0 (an unbatched input's dim 0 is "
                           "its channels)")
    return [0]


def _spatial(count_of, channels: bool = False) -> Any:
    """Pooling, padding, upsampling: per channel, along the last ``count_of(node)`` dims;
    ``channels``: a channel dim comes before them (an input of one more dim is unbatched: its dim 0
    is the channels). Every other tensor the op reads (max_unpool's indices, fractional max
    pooling's random samples) is per sample too, batched along the input's dim."""

    def rule(node: fx.Node, c: _Context) -> _Dims:
        dim, rank = _first_dim(node, c), len(_shape(node.args[0]))
        if dim >= rank - count_of(node):
            raise _mixed(node, "acts along the batch dim (one of its spatial dims)")
        if channels and rank == count_of(node) + 1:
            raise _mixed(node, "takes its input as unbatched (its dim 0 is the channels)")
        for arg in _tensor_args(node)[1:]:
            if arg is not node.args[0] and c.dim(arg) != dim:
                raise _mixed(node, f"reads {arg.name} per sample, which is not batched as its input is")
        return [dim if isinstance(leaf, torch.Tensor) else None for leaf in leaves(_val(node))]

    return rule


def _kernel_dims(node: fx.Node) -> int:
    name = _name(node)
    return next((int(digit) for digit in "123" if f"{digit}d" in name), 1)


def _padding(node: fx.Node, c: _Context) -> _Dims:
    """pad / constant_pad_nd / reflection and replication pads: ``pad`` gives (before, after) for
    the last dims, last first; a batch dim padded by nothing is kept."""
    dim, rank, pad = _first_dim(node, c), len(_shape(node.args[0])), list(node.args[1])
    padded = {rank - 1 - i for i in range(len(pad) // 2) if pad[2 * i] != 0 or pad[2 * i + 1] != 0}
    if dim in padded:
        raise _mixed(node, "pads along the batch dim")
    return [dim]


def _dtype_of_second(node: fx.Node, c: _Context) -> _Dims:
    """``x.type_as(y)``: x's values in y's dtype."""
    return [c.dim(node.args[0])]


def _normalized(node: fx.Node, c: _Context) -> _Dims:
    """layer_norm / rms_norm: per sample, over the trailing ``normalized_shape`` dims."""
    dim, rank = _first_dim(node, c), len(_shape(node.args[0]))
    if dim >= rank - len(node.args[1]):
        raise _mixed(node, "normalises over the batch dim")
    return [dim if isinstance(leaf, torch.Tensor) else None for leaf in leaves(_val(node))]


_BATCH_STATISTICS = {"_batch_norm_with_update", "native_batch_norm", "batch_norm", "_native_batch_norm_legit"}


def _per_sample_norm(node: fx.Node, c: _Context) -> _Dims:
    """group_norm / instance_norm (statistics per sample), and batch_norm when it uses its running
    statistics instead of the batch's: dim 0 must be the batch."""
    name = _name(node)
    if name in _BATCH_STATISTICS and (name == "_batch_norm_with_update" or _argument(node, "training", False)):
        raise _mixed(node, "normalises with statistics of the whole batch (BatchNorm in training)")
    if name == "instance_norm" and _argument(node, "use_input_stats") and _argument(node, "running_mean") is not None:
        # each sample's output is its own, but the running statistics take the batch's mean of them once
        # a step: each microbatch would apply the momentum in turn
        raise _mixed(node, "updates its running statistics with the mean over the batch (InstanceNorm with "
                           "track_running_stats in training)")
    if _first_dim(node, c) != 0 or len(_shape(node.args[0])) < 2:
        raise _mixed(node, "normalises a value whose batch dim is not its dim 0")
    return [0] + [None] * (len(leaves(_val(node))) - 1)


def _attention(node: fx.Node, c: _Context) -> _Dims:
    """Each sample's query attends over its own keys and values; a query, key or value every sample
    shares (BLIP-2's learned queries, expanded to the batch) is the same for each, as a shared
    operand of a broadcast is."""
    q, k, v = node.args[:3]
    if all(c.dim(arg) is None for arg in (q, k, v)):
        raise _mixed(node, "attends over a query, key and value every sample shares")
    for arg in (q, k, v):
        dim = c.dim(arg)
        if dim is not None and dim >= len(_shape(arg)) - 2:
            raise _mixed(node, "attends along the batch dim")
    dim = _broadcast(node, [q, k, v], c, _shape(q))
    mask = _argument(node, "attn_mask")
    if isinstance(mask, fx.Node):
        _broadcast(node, [mask], c, _shape(q), dim=dim)
    return [dim if isinstance(leaf, torch.Tensor) and leaf.dim() > dim else None for leaf in leaves(_val(node))]


def _recurrent(node: fx.Node, c: _Context) -> _Dims:
    """lstm / gru / rnn_* on padded input: ``[T, B, H]`` (``[B, T, H]`` with batch_first), states
    ``[layers, B, H]``; an unbatched ``[T, H]`` input is a sequence, not a batch."""
    x = node.args[0]
    if node.target._overloadname != "input":
        raise _mixed(node, "runs over a packed sequence")
    batch_first = bool(node.args[-1])
    if len(_shape(x)) != 3 or c.dim(x) != (0 if batch_first else 1):
        raise _mixed(node, "runs over an unbatched sequence (its dim 0 is time) or a batch along another dim")
    states = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
    for state in states:
        if isinstance(state, fx.Node) and c.dim(state) != 1 and (c.dim(state) is not None or c.varies_along(state, 1)):
            raise _mixed(node, "starts from a state that is not batched along its dim 1")
    return [0 if batch_first else 1] + [1] * (len(leaves(_val(node))) - 1)


def _cell(node: fx.Node, c: _Context) -> _Dims:
    """lstm_cell / gru_cell / rnn_*_cell: input ``[B, H]``."""
    if len(_shape(node.args[0])) != 2 or _first_dim(node, c) != 0:
        raise _mixed(node, "runs a cell on an unbatched input")
    return [0] * len(leaves(_val(node)))


def _loss(node: fx.Node, c: _Context) -> _Dims:
    """A loss with ``reduction``: over classes in dim 1 (cross_entropy, nll, multi_margin) or
    element by element (mse, l1, bce, kl_div, ...); reduced, it is a loss for the output."""
    source = node.args[0]
    if _name(node) in _CLASS_LOSSES:
        if len(_shape(source)) < 2 or c.dim(source) != 0:
            raise _mixed(node, "computes a loss over an unbatched input (its dim 0 is the classes)")
        for arg in _tensor_args(node)[1:]:
            if c.dim(arg) not in (0, None) or (c.dim(arg) is None and arg.meta[meta.VAL].dim() > 1):
                raise _mixed(node, "takes a target that is not batched along its dim 0")
        kept = 0
    else:
        args = _tensor_args(node)
        kept = _broadcast(node, args, c, torch.broadcast_shapes(*[_shape(a) for a in args]))
    rest = [None] * (len(leaves(_val(node))) - 1)
    if _argument(node, "reduction", 1) == 0:
        return [kept] + rest
    return [_REDUCED] + rest


def _subgraph(node: fx.Node, c: _Context) -> _Dims:
    """A higher-order op (a ``no_grad`` or autocast region): the rules, inside its subgraph."""
    root = node.graph.owning_module
    position = next(i for i, arg in enumerate(node.args) if isinstance(arg, fx.Node) and arg.op == "get_attr")
    sub = getattr(root, node.args[position].target)
    placeholders = sub.graph.find_nodes(op="placeholder")
    inner = {p.name: c.env[arg] if isinstance(arg, fx.Node) else [None]
             for p, arg in zip(placeholders, node.args[position + 1:])}
    inner_env, inner_c = _propagate(sub, inner, c.batch_size)
    outputs = sub.graph.find_nodes(op="output")[0].args[0]
    outputs = outputs if isinstance(outputs, (tuple, list)) else [outputs]
    if any(inner_c.outer.get(out, 1) > 1 for out in outputs if isinstance(out, fx.Node)):
        raise _mixed(node, "returns from its region a batch interleaved with other dims")
    return [d for out in outputs for d in (inner_env[out] if isinstance(out, fx.Node) else [None])]


def _autograd_function(node: fx.Node, c: _Context) -> _Dims:
    """A model's own ``torch.autograd.Function`` (``ir.autograd_functions``): its forward, and its
    forward with its own backward, traced on fakes and read by these rules. The samples stay apart
    where both keep them apart and each input's gradient is batched as the input is (a gradient
    of a shared input, which its backward would sum over the batch, is not followed)."""
    key, tensors = node.args
    outputs = leaves(_val(node))
    graphs = autograd_functions.traced(key, [_val(t) for t in tensors], outputs)
    if graphs is None:
        raise _mixed(node, f"is a custom autograd Function ({key}) whose forward or backward cannot be traced on "
                           "fakes (it reads values), so how it treats the batch is unknown")
    forward, joint = graphs
    part = "its forward"
    try:
        inputs = {p.name: list(c.env[t]) for p, t in zip(forward.graph.find_nodes(op="placeholder"), tensors)}
        forward_env, forward_c = _propagate(forward, inputs, c.batch_size)
        results = list(forward.graph.find_nodes(op="output")[0].args[0])
        dims = [forward_env[r][0] if isinstance(r, fx.Node) else None for r in results]
        if any(d == _REDUCED for d in dims) or any(r in forward_c.outer or r in forward_c.sorted for r in results):
            raise _Mixed("returns the batch reduced, interleaved or sorted")
        part = "its backward"
        placeholders = joint.graph.find_nodes(op="placeholder")
        seeds = [list(c.env[t]) for t in tensors] + [[d] for d in dims]
        joint_env, joint_c = _propagate(joint, {p.name: d for p, d in zip(placeholders, seeds)}, c.batch_size)
        grads = list(joint.graph.find_nodes(op="output")[0].args[0])[len(results):]
        for tensor, grad in zip(tensors, grads):
            if isinstance(grad, fx.Node) and (joint_env[grad] != c.env[tensor] or grad in joint_c.outer
                                              or grad in joint_c.sorted):
                raise _Mixed(f"gives {tensor.name} a gradient batched otherwise than it is")
    except _Mixed as inner:
        raise _mixed(node, f"is a custom autograd Function ({key}) that mixes the samples: {part}: {inner}") from inner
    return dims


# ops returning a size, not values computed from the samples
_SIZE_QUERIES = {"sym_size", "sym_numel", "sym_stride", "sym_storage_offset", "_assert_tensor_metadata"}

# ops with no pointwise tag that still work element by element (or leave values in place)
_ELEMENTWISE = {"dropout", "native_dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout",
                "hardswish", "alias", "detach", "_to_copy", "to", "type_as", "copy", "copy_", "fill_", "fill",
                "exponential_", "bernoulli", "bernoulli_", "rrelu_with_noise", "masked_fill", "masked_fill_",
                "_prelu_kernel", "prelu", "log_sigmoid", "log_sigmoid_forward", "zero_", "lift_fresh_copy",
                "contiguous",
                "uniform_", "normal_", "clamp_", "relu_", "hardtanh_", "gelu_", "silu_", "leaky_relu_", "elu_",
                "threshold_", "sigmoid_", "tanh_", "add_", "mul_", "div_", "sub_", "clone", "zeros_like",
                "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "dropout_", "hardswish_",
                "hardsigmoid_", "mish_", "celu_", "selu_", "rrelu_with_noise_", "rrelu", "__and__", "__or__",
                "__xor__", "__invert__", "__iand__", "__ior__", "__ixor__", "bitwise_and", "bitwise_or",
                "bitwise_xor", "bitwise_not", "logical_and", "logical_or", "logical_xor", "real", "imag"} | _ENTRYWISE

_CLASS_LOSSES = {"cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss2d", "nll_loss_forward",
                 "nll_loss2d_forward", "multi_margin_loss", "multilabel_margin_loss", "multilabel_margin_loss_forward"}
_ELEMENT_LOSSES = {"mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
                   "binary_cross_entropy_with_logits", "kl_div", "soft_margin_loss", "hinge_embedding_loss",
                   "poisson_nll_loss", "margin_ranking_loss"}

# the rules that, where they accept a batch dim, compute each of its rows from the same rows
_ROW_WISE = {_along, _reduction, _matmul, _einsum, _normalized, _attention, _loss, _select, _split, _cat, _gather,
             _scatter, _expand, _broadcast_tensors, _repeat, _transpose, _permute, _unsqueeze, _unchanged_leading,
             _padding, _dtype_of_second, _unfold}

_RULES = {
    **{name: _reshape for name in _VIEWS},
    **{name: _along for name in ("softmax", "_softmax", "log_softmax", "_log_softmax", "cumsum", "cumprod",
                                 "logcumsumexp", "flip", "roll", "sort", "topk", "kthvalue", "glu", "_safe_softmax",
                                 "cummax", "cummin", "diff", "repeat_interleave", "fft_fft", "fft_ifft", "fft_rfft",
                                 "fft_irfft", "fft_hfft", "fft_ihfft", "fft_fft2", "fft_ifft2", "fft_rfft2",
                                 "fft_irfft2", "fft_fftn", "fft_ifftn", "fft_rfftn", "fft_irfftn", "_fft_r2c",
                                 "_fft_c2r", "_fft_c2c")},
    **{name: _reduction for name in ("sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "var", "std",
                                     "var_mean", "std_mean", "prod", "logsumexp", "norm", "linalg_vector_norm",
                                     "all", "any", "median", "nansum", "nanmean", "count_nonzero")},
    **{name: _matmul for name in ("mm", "bmm", "matmul", "linear", "addmm", "baddbmm")},
    **{name: _convolution for name in ("convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
                                       "conv_transpose2d", "conv_transpose3d", "_convolution")},
    **{name: _spatial(_kernel_dims, channels=True) for name in (
        "max_pool1d", "max_pool2d", "max_pool3d", "max_pool2d_with_indices", "max_pool3d_with_indices",
        "avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
        "adaptive_avg_pool3d", "_adaptive_avg_pool2d", "_adaptive_avg_pool3d", "adaptive_max_pool1d",
        "adaptive_max_pool2d", "adaptive_max_pool3d", "fractional_max_pool2d", "fractional_max_pool3d",
        "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "upsample_bilinear2d",
        "upsample_linear1d", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_nearest_exact1d",
        "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "max_unpool2d", "max_unpool3d")},
    # channels and space moved into each other: the last three dims; channel_shuffle: [N, C, *]
    **{name: _spatial(lambda node: 3) for name in ("pixel_shuffle", "pixel_unshuffle")},
    "channel_shuffle": _per_leading_sample, "native_channel_shuffle": _per_leading_sample,
    **{name: _spatial(lambda node: 2) for name in ("triu", "tril")},
    # per matrix (the last two dims), per image (F.unfold, F.fold: the batch dim leads)
    **{name: _spatial(lambda node: 2) for name in ("linalg_cholesky", "linalg_cholesky_ex", "cholesky", "linalg_inv",
                                                   "linalg_inv_ex", "inverse", "linalg_det", "_linalg_det", "det",
                                                   "linalg_slogdet", "_linalg_slogdet", "logdet", "linalg_eigh",
                                                   "_linalg_eigh", "linalg_qr", "linalg_svd", "_linalg_svd",
                                                   "im2col", "col2im")},
    "one_hot": _entrywise_then_new_dims, "bucketize": _entrywise_then_new_dims,
    "affine_grid_generator": _per_leading_sample,
    **{name: _padding for name in ("constant_pad_nd", "pad", "reflection_pad1d", "reflection_pad2d",
                                   "reflection_pad3d", "replication_pad1d", "replication_pad2d", "replication_pad3d",
                                   "_pad_circular")},
    **{name: _normalized for name in ("layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm")},
    **{name: _per_sample_norm for name in ("group_norm", "native_group_norm", "instance_norm", "batch_norm",
                                           "native_batch_norm", "_native_batch_norm_legit",
                                           "_native_batch_norm_legit_no_training", "_batch_norm_with_update",
                                           "_batch_norm_no_update")},
    **{name: _attention for name in ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
                                     "_scaled_dot_product_attention_math", "_scaled_dot_product_efficient_attention",
                                     "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention")},
    **{name: _recurrent for name in ("lstm", "gru", "rnn_tanh", "rnn_relu")},
    **{name: _cell for name in ("lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell")},
    **{name: _loss for name in _CLASS_LOSSES | _ELEMENT_LOSSES},
    **{name: _select for name in ("select", "index_select", "slice", "narrow")}, "unfold": _unfold,
    **{name: _split for name in ("split", "split_with_sizes", "chunk", "unbind", "tensor_split")},
    "expand": _expand, "expand_as": _expand, "broadcast_tensors": _broadcast_tensors,
    **{name: _transpose for name in _TRANSPOSES}, "permute": _permute,
    "unsqueeze": _unsqueeze, "cat": _cat, "concat": _cat, "concatenate": _cat, "stack": _cat, "index": _index,
    "gather": _gather,
    **{name: _scatter for name in ("scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce",
                                   "scatter_reduce_")},
    "embedding": _embedding, "embedding_bag": _embedding_bag, "_embedding_bag": _embedding_bag, "repeat": _repeat,
    "einsum": _einsum, "type_as": _dtype_of_second,
    "autograd_function": _autograd_function,
    # complex values seen as pairs of reals and back: a trailing dim of 2 added or removed
    "view_as_real": _unchanged_leading, "view_as_complex": _unchanged_leading,
}
