"""How a scalar output (a loss) reduces the batch: the one analysis of it.

A scalar has no batch dim to concatenate microbatches' values along; ``scalar_reduction`` reads
from the captured graph how the model reduced the batch, so that microbatches' values can be put
back together exactly as eager computes the whole batch's (``frontend.microbatch.scalar_weights``
turns it into one coefficient per microbatch):

* a mean over labelled items (``cross_entropy``, ``nll_loss``): weighted by how many labels each
  microbatch has that are not ``ignore_index`` (counted on the host from the labels input);
  the same for a sum over the batch divided by its count of such labels (torchtune's
  ``CEWithChunkedOutputLoss``: ``sum of cross_entropy(..., reduction="sum") / (labels != -100).sum()``);
* a mean over all elements (``mean``, ``mse_loss``, ...): weighted by the number of elements;
* a sum: every coefficient is 1;
* a mean or sum scaled by a number (``kl_div(reduction="batchmean")``, ``loss.sum() / x.numel()``,
  ``0.5 * kl.sum()``): each graph holds the number at its own size, which may be the batch's size,
  grow with it, or be a constant. Where the batch is cut, the whole batch's graph is captured beside
  the microbatches' and its number weighs them exactly (``multiplier``: microbatch i weighs the
  whole's number over its own, times its share). Only across processes, where no graph holds the
  whole batch, is it guessed: a divisor is the batch size when it equals each microbatch's size or
  differs between them, a factor a constant unless it is one over each microbatch's differing size;
* a sum or mean of a number already reduced (``loss.sum()`` of a mean) is that number;
* a linear combination of these (``out[0].pow(2).mean() + 0.1 * out[1].abs().mean()``), possibly
  plus a value computed without the batch (a penalty on the parameters): put back together with
  one weight per microbatch when every term weighs the microbatches alike (means of per-sample
  values do; a sum and a mean do not, and are refused saying so).

``analysis.batch_dims`` asks it whether a loss can be cut (for the planner, and for forward
microbatches larger than the backward's), and the runtime's weights come from it.
"""
from __future__ import annotations

import dataclasses
import enum
import operator
from typing import Any, Callable, Mapping

import torch
from torch import fx

from harmony_fx.analysis.aliasing import aliased, written_arguments
from harmony_fx.ir import meta

__all__ = ["Combine", "ScalarReduction", "scalar_reduction"]

aten = torch.ops.aten


class Combine(enum.Enum):
    MEAN = "mean"
    SUM = "sum"
    LINEAR = "linear"  # a linear combination of means and sums (``ScalarReduction.terms``)


@dataclasses.dataclass(frozen=True)
class ScalarReduction:
    """How one microbatch's value of a scalar output enters the whole batch's.

    ``combine``: ``MEAN`` weights microbatch i by ``count(inputs_i)`` (the number of items its mean
    is over; ``inputs_i``: placeholder name → the microbatch's input), ``SUM`` adds the values;
    ``LINEAR``: a linear combination of ``terms`` (each a ``MEAN`` or ``SUM``), which one weight per
    microbatch puts back together when every term weighs the microbatches alike; ``None`` when the
    graph does not say, and ``why`` tells the user what to do instead.
    """

    combine: Combine | None
    count: Callable[[Mapping[str, torch.Tensor]], int] | None = None
    why: str = ""
    # the constant the reduction was divided by on its way to the output (None: it was not divided)
    divisor: float | None = None
    # the constant it was multiplied by (None: it was not): a constant factor, unless it differs
    # between microbatch sizes as one over the size (``loss.sum() * (1 / x.shape[0])``)
    scale: float | None = None
    terms: tuple[ScalarReduction, ...] = ()
    # LINEAR: it also adds a value computed without the batch (a constant, a penalty on the
    # parameters), which every microbatch computes whole: right only if the weights add up to 1
    shared: bool = False
    node: str = ""  # the node that reduces, for messages
    # MEAN over labelled items: what its count reads (the labels' node, ignore_index, class weights),
    # so terms over the same labels are known to weigh the microbatches alike whatever the labels
    labels: tuple | None = None

    @property
    def multiplier(self) -> float:
        """The number the reduction was multiplied by on its way to the output (1 where none was)."""
        return (1.0 if self.scale is None else self.scale) / (1.0 if self.divisor is None else self.divisor)

    @property
    def weighed_by_labels(self) -> str:
        """Why one weight per microbatch may not serve every term, depending on the batch's labels
        (a mean over labelled tokens plus a mean over every element: alike until a microbatch has
        more ignored labels than another); ``""`` where the terms weigh alike whatever the labels."""
        labelled = [term for term in self.terms if term.labels is not None]
        if not labelled or all(term.labels == labelled[0].labels for term in self.terms):
            return ""
        other = next(term for term in self.terms if term.labels != labelled[0].labels)
        return (f"the loss {self.node!r} adds the mean over labelled items {labelled[0].node!r} to {other.node!r}, "
                "which microbatches weigh alike only while each holds as many ignored labels as its share of the "
                "batch: the batch is kept whole (cut by hand, a call where they differ raises)")

    @property
    def scaled(self) -> bool:
        """Whether a number multiplies or divides a term, which may be the batch's size (or a count
        that grows with it): then only the whole batch's graph says how it weighs the microbatches."""
        return any(term.scale is not None or term.divisor is not None for term in (self.terms or (self,)))


# ops a scalar passes through unchanged in kind: a mean stays a mean, a sum a sum
_PASS_THROUGH = {aten.alias.default, aten.clone.default, aten.view.default, aten.reshape.default,
                 aten.squeeze.default, aten.to.dtype, aten._to_copy.default, aten.contiguous.default,
                 aten.detach.default, aten.neg.default}
_SCALED = {aten.mul.Tensor, aten.div.Tensor, aten.mul_.Tensor, aten.div_.Tensor}  # by a number, when one is
_REDUCTIONS = {aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim}
_LABELLED_LOSSES = {aten.cross_entropy_loss.default, aten.nll_loss_nd.default, aten.nll_loss.default,
                    aten.nll_loss2d.default, aten.nll_loss_forward.default}
_MEAN_REDUCTION, _SUM_REDUCTION = 1, 2  # at::Reduction
_SHARED = object()  # a term of a sum that does not depend on the batch
# ops that make a tensor of a size given as numbers, which the capture fixed (perhaps the batch's)
_SIZED_FROM_NUMBERS = {aten.expand.default, aten.repeat.default, aten.new_empty.default, aten.new_zeros.default,
                       aten.new_ones.default, aten.new_full.default}


def scalar_reduction(gm: fx.GraphModule, node: fx.Node,
                     state: Mapping[str, torch.Tensor] | None = None) -> ScalarReduction:
    """How the scalar ``node`` (an output of the captured ATen graph ``gm``) reduces its batch: one
    mean or sum of the batch, or a linear combination of them (``loss_a.mean() + 0.5 * loss_b.sum()
    / n``), possibly plus values that do not depend on the batch. This is the one place that decides
    it: ``analysis.batch_dims`` asks it whether a loss can be cut, and the runtime's weights come
    from it (``scalar_weights``). ``state``: the model's parameters and buffers by placeholder name,
    which a count may read (a cross entropy's class weights); without it, only whether the loss can
    be cut is known (the counts refuse to run)."""
    terms = _terms(gm, node, None, node, state)
    failed = [term for term in terms if term is not _SHARED and term.combine is None]
    if failed:
        return failed[0]
    reductions = [term for term in terms if term is not _SHARED]
    if not reductions:
        return ScalarReduction(None, why=(
            f"the model's output {node.name!r} is a number computed without the batch, which every microbatch would "
            "compute whole; compute it outside the model, or use microbatches=1."))
    if len(terms) == 1:
        return reductions[0]
    # a sum neither divided nor multiplied (a factor may be one over the size: decided at run time)
    sums = [term.node for term in reductions if term.combine == Combine.SUM and term.divisor is None and term.scale is None]
    means = [term.node for term in reductions if term.combine == Combine.MEAN]
    if sums and (means or len(reductions) < len(terms)):
        # a sum counts each microbatch's value whole, a mean (and a value computed without the
        # batch, which every microbatch computes) by its share: no one weight serves both
        other = f"the mean {means[0]!r}" if means else "a value computed without the batch"
        return ScalarReduction(None, why=(
            f"the model's output {node.name!r} adds the sum {sums[0]!r} over the batch to {other}, which the "
            "microbatches weigh differently (a sum by 1 each, a mean by each microbatch's share of the batch); "
            "reduce every term the same way (all means or all sums), or use microbatches=1."))
    return ScalarReduction(Combine.LINEAR, terms=tuple(reductions), shared=len(reductions) < len(terms),
                           node=node.name)


def _terms(gm: fx.GraphModule, node: fx.Node, divisor: float | None, origin: fx.Node,
           state: Mapping[str, torch.Tensor] | None = None, scale: float | None = None) -> list:
    """The reductions ``node`` adds up (each a ``ScalarReduction``, ``combine=None`` where the graph
    does not say), and ``_SHARED`` for each term that does not depend on the batch. ``divisor``:
    what the terms were divided by on the way from ``node`` to the output."""
    inputs, made = _sources(node)
    if not inputs:
        return [_unknown_size(origin, made[0], "adds")] if made else [_SHARED]
    while node.op == "call_function":
        target = node.target
        if target in _PASS_THROUGH or (target in _REDUCTIONS and _is_scalar(node.args[0])):
            node = node.args[0]  # a sum or mean of one number is that number (loss.sum() of a mean)
        elif target in _SCALED and any(isinstance(a, (int, float)) for a in node.args[:2]):
            # in place too: transformers' Trainer.compute_loss ends with ``loss *= num_processes``
            (factor,) = [a for a in node.args[:2] if isinstance(a, (int, float))]
            (node,) = [a for a in node.args[:2] if isinstance(a, fx.Node)]
            if factor == 0:
                return []  # nothing of it reaches the output
            if target in (aten.div.Tensor, aten.div_.Tensor):
                divisor = _scaled(divisor, factor)
            else:  # a factor (beta * kl): not taken for one over the batch size it may happen to equal
                scale = _scaled(scale, factor)
        elif target is aten.div.Tensor and isinstance(node.args[1], fx.Node):
            inputs, made = _sources(node.args[1])
            if made and not inputs:
                return [_unknown_size(origin, made[0], "divides by")]
            if not made and (mean := _sum_over_labelled(gm, node, origin, state)) is not None:
                return [dataclasses.replace(mean, scale=scale, divisor=divisor)]
            if made or any(_sized(placeholder) for placeholder in inputs):
                break
            # divided by a number every microbatch has whole (a 0-dim input such as transformers'
            # num_items_in_batch, the whole batch's labelled tokens): each microbatch's value is its
            # share of the batch's, weighed as the dividend is
            node = node.args[0]
        elif len(node.args) == 2 and (target in (aten.add.Tensor, aten.sub.Tensor) or (
                # ``total += term`` (torchtune's chunked cross entropy), into a value nothing else reads
                target in (aten.add_.Tensor, aten.sub_.Tensor) and len(node.args[0].users) == 1)):
            left, right = node.args
            alpha = node.kwargs.get("alpha", 1)
            right_terms = [] if alpha == 0 or _is_zero(right) else (
                _terms(gm, right, divisor, origin, state, scale if alpha == 1 else _scaled(scale, alpha))
                if isinstance(right, fx.Node)
                else [_SHARED])
            left_terms = [] if _is_zero(left) else (
                _terms(gm, left, divisor, origin, state, scale) if isinstance(left, fx.Node) else [_SHARED])
            return left_terms + right_terms
        elif target is operator.getitem and node.args[1] == 0 and node.args[0].target is aten.nll_loss_forward.default:
            node = node.args[0]  # (loss, total_weight)
        else:
            break
    reduction = _reduction(gm, node, divisor, origin, state)
    if reduction.combine is None:
        return [reduction]
    return [dataclasses.replace(reduction, node=node.name, scale=scale, divisor=divisor)]


def _sum_over_labelled(gm: fx.GraphModule, node: fx.Node, origin: fx.Node,
                       state: Mapping[str, torch.Tensor] | None) -> ScalarReduction | None:
    """A sum over the batch divided by the batch's count of labels that are not ``ignore_index``
    (torchtune's ``CEWithChunkedOutputLoss``: cross entropies with ``reduction="sum"`` added up,
    over ``(labels != ignore_index).sum()``): a mean over labelled items, each microbatch weighed
    by its own count, since both the sum and the count add up over the microbatches. ``None`` where
    ``node`` (a ``div``) is not that."""
    count = _unwrapped(node.args[1])
    if (count.op != "call_function" or count.target not in (aten.sum.default, aten.sum.dim_IntList)
            or not _is_scalar(count)):
        return None
    compared = count.args[0]
    if (not isinstance(compared, fx.Node) or compared.target is not aten.ne.Scalar
            or not isinstance(compared.args[0], fx.Node)):
        return None
    terms = _terms(gm, node.args[0], None, origin, state)
    if not terms or any(term is _SHARED or term.combine != Combine.SUM or term.scale is not None
                        or term.divisor is not None for term in terms):
        return None
    return dataclasses.replace(_labels_kept(gm, compared.args[0], compared.args[1], state), node=node.name)


def _unwrapped(node: fx.Node) -> fx.Node:
    """``node`` through ops that leave a number as it is (a count cast to float is the same count)."""
    while node.op == "call_function" and node.target in _PASS_THROUGH and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _is_zero(value: Any) -> bool:
    # a sum begun at 0 (``aux = 0; aux = aux + term``) adds nothing every microbatch would repeat
    return isinstance(value, (int, float)) and value == 0


def _scaled(value: float | None, factor: float) -> float:
    # a sign changes nothing in how microbatches combine
    return abs(factor) if value is None else value * abs(factor)


def _sources(node: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """What ``node`` is computed from that may differ between microbatches: the model's input
    placeholders, and tensors made inside the model at a size given as numbers, from no tensor
    (``torch.rand(x.shape[0], ...)``) or larger than their tensor (``cls_token.expand(x.shape[0], ...)``):
    a size the capture baked in, which may be the microbatch's."""
    seen: set[fx.Node] = set()
    stack, inputs, made = [node], [], []
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        # what writes into it in place, or into a view of it, adds to its value (z[:, :16] = v)
        stack.extend(user for user in current.users if current in written_arguments(user) or aliased(user) is current)
        if current.op == "placeholder" and meta.role_of(current) == meta.Role.INPUT:
            inputs.append(current)
        elif current.op == "call_function" and _sized(current) and (
                not current.all_input_nodes or (current.target in _SIZED_FROM_NUMBERS and _grows(current))):
            made.append(current)
        stack.extend(current.all_input_nodes)
    return inputs, made


def _is_scalar(node: object) -> bool:
    value = node.meta.get(meta.VAL) if isinstance(node, fx.Node) else None
    return isinstance(value, torch.Tensor) and value.dim() == 0


def _sized(node: fx.Node) -> bool:
    value = node.meta.get(meta.VAL)
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _grows(node: fx.Node) -> bool:
    source = node.args[0].meta.get(meta.VAL)
    return isinstance(source, torch.Tensor) and node.meta[meta.VAL].numel() > source.numel()


def _unknown_size(origin: fx.Node, made: fx.Node, how: str) -> ScalarReduction:
    return ScalarReduction(None, why=(
        f"the model's output {origin.name!r} {how} a number computed from {meta.describe(made)}, a tensor made "
        "inside the model whose size the capture fixed and which may be the microbatch's, so it may differ "
        "between microbatches and the whole batch; compute it outside the model, or use microbatches=1."))


def _reduction(gm: fx.GraphModule, node: fx.Node, divisor: float | None, origin: fx.Node,
               state: Mapping[str, torch.Tensor] | None) -> ScalarReduction:
    """The one reduction of the batch at ``node``."""
    target = node.target
    if target in (aten.sum.default, aten.sum.dim_IntList):
        return ScalarReduction(Combine.SUM, divisor=divisor)
    if target in _REDUCTIONS:
        return _mean_over_elements(node.args[0])
    reduction = _argument(node, "reduction") if isinstance(target, torch._ops.OpOverload) else None
    if reduction == _SUM_REDUCTION:
        return ScalarReduction(Combine.SUM, divisor=divisor)
    if reduction == _MEAN_REDUCTION and target in _LABELLED_LOSSES:
        return _mean_over_labels(gm, node, state)
    if reduction == _MEAN_REDUCTION:  # mse_loss, l1_loss, binary_cross_entropy, ...: every element
        return _mean_over_elements(node.args[0])
    return ScalarReduction(None, why=(
        f"the model's output {origin.name!r} is one number per microbatch, made by {meta.describe(node)}, and "
        "harmony_fx only knows how to put means and sums of the batch (cross_entropy, mse_loss, mean, sum, ...) "
        "and their linear combinations back together; return per-sample values (reduction='none'), or use "
        "microbatches=1."))


def _mean_over_elements(value: fx.Node) -> ScalarReduction:
    numel = value.meta[meta.VAL].numel()
    return ScalarReduction(Combine.MEAN, lambda inputs: numel)


def _mean_over_labels(gm: fx.GraphModule, loss: fx.Node, state: Mapping[str, torch.Tensor] | None) -> ScalarReduction:
    """A cross entropy's mean is over the targets that are not ``ignore_index``, each counted by its
    class's weight where the loss weighs its classes (``weight=``: torch divides by the weights of
    the targets it kept, so a microbatch's share is the weight of its own)."""
    target = loss.args[1].meta.get(meta.VAL)
    if isinstance(target, torch.Tensor) and target.is_floating_point():
        # class probabilities (soft targets): torch's mean is over every sample, whatever the weights
        return _mean_over_elements(loss.args[1])
    ignore_index, weight = _argument(loss, "ignore_index"), _argument(loss, "weight")
    if weight is None:
        return _labels_kept(gm, loss.args[1], ignore_index, state)
    try:
        labels = _function_of(gm, loss.args[1], "labels", state)
        class_weights = _function_of(gm, weight, "class weights", state, inputs=False)
    except ValueError as error:
        return ScalarReduction(None, why=str(error))
    read = (_reshaped_from(loss.args[1]).name, ignore_index, weight.name)

    def weight_of_kept(inputs: Mapping[str, torch.Tensor]) -> float:
        kept = labels(inputs)
        kept = kept[kept != ignore_index]
        return float(class_weights({}).detach().to("cpu", torch.float64)[kept.to("cpu")].sum())

    return ScalarReduction(Combine.MEAN, weight_of_kept, labels=read)


def _labels_kept(gm: fx.GraphModule, labels: fx.Node, ignore_index: int,
                 state: Mapping[str, torch.Tensor] | None) -> ScalarReduction:
    """A mean over the labels ``labels`` holds that are not ``ignore_index``: each microbatch weighed
    by how many it has."""
    try:
        count = _function_of(gm, labels, "labels", state)
    except ValueError as error:
        return ScalarReduction(None, why=str(error))
    return ScalarReduction(Combine.MEAN, lambda inputs: int((count(inputs) != ignore_index).sum()),
                           labels=(_reshaped_from(labels).name, ignore_index, None))


# ops whose result holds its input's values, each once: labels reshaped by each term of a loss
# (``labels.view(-1)`` at every depth of a deeply supervised model) are the same labels
_SAME_VALUES_RESHAPED = frozenset({"view", "reshape", "_unsafe_view", "_reshape_alias", "flatten", "contiguous",
                                   "clone", "alias", "detach", "squeeze", "unsqueeze"})


def _reshaped_from(node: fx.Node) -> fx.Node:
    while (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
           and node.target._schema.name.split("::")[-1] in _SAME_VALUES_RESHAPED and isinstance(node.args[0], fx.Node)):
        node = node.args[0]
    return node


def _function_of(gm: fx.GraphModule, node: fx.Node, what: str, state: Mapping[str, torch.Tensor] | None = None,
                 inputs: bool = True) -> Callable[[Mapping[str, torch.Tensor]], torch.Tensor]:
    """``node``'s value computed by a copy of the part of ``gm`` that makes it (taken before any
    pass retargets the graph, so it runs on the host): from the model's inputs (``inputs=True``;
    the function takes them by placeholder name), or from its parameters and buffers as ``state``
    holds them (``inputs=False``: read at each call, so a weight changed in place counts)."""
    needed: set[fx.Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current not in needed:
            needed.add(current)
            stack.extend(current.all_input_nodes)
    placeholders = [n for n in gm.graph.nodes if n in needed and n.op == "placeholder"]
    if inputs:
        parameters = [str(n.meta.get(meta.TARGET, n.name)) for n in placeholders if meta.role_of(n) == meta.Role.PARAM]
        if parameters:
            raise ValueError(f"the {what} of {node.name!r} are computed from the model's parameters {parameters} "
                             f"(labels the model predicts); harmony_fx counts each microbatch's {what} from its "
                             "inputs, buffers and constants. Use microbatches=1.")
    else:
        batch = [n.name for n in placeholders if meta.role_of(n) == meta.Role.INPUT]
        if batch:
            raise ValueError(f"the {what} of {node.name!r} are computed from the batch {batch}, so a microbatch's "
                             "share of the batch's mean depends on the rest of the batch; use reduction='sum' (and "
                             "divide by the batch's total weight yourself) or microbatches=1.")
    graph = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n in needed:
            copies[n] = graph.node_copy(n, copies.__getitem__)
    graph.output(copies[node])
    function = fx.GraphModule(gm, graph)
    names = [n.name for n in placeholders]
    if inputs:  # and buffers or constants (tt[tt < 0] = -100 reads a constant export lifted), from state
        kept = {n.name: (state or {}).get(n.name) for n in placeholders if meta.role_of(n) != meta.Role.INPUT}
        return lambda values: function(*[kept[name] if name in kept else values[name] for name in names])

    if state is None:  # only whether the loss can be cut is asked
        return lambda _: _raise(AssertionError(f"the {what} of {node.name!r} read the model's state, not given"))
    held = [state[name] for name in names]  # these tensors alone: the function keeps no other parameter alive

    def from_state(_: Mapping[str, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            return function(*held)

    return from_state


def _raise(error: Exception):
    raise error


def _argument(node: fx.Node, name: str) -> Any:
    """The value of the ATen op's argument ``name`` at ``node``, its schema default if not given."""
    for index, argument in enumerate(node.target._schema.arguments):
        if argument.name == name:
            if index < len(node.args):
                return node.args[index]
            return node.kwargs.get(name, argument.default_value if argument.has_default_value() else None)
    return None
