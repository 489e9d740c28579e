"""What compiling made, frozen: the packs, the programs, the plan and the log of the stages.

``Compiled`` is data: it runs nothing (``runtime.session.Session`` runs it) and marshals nothing
(``frontend.calls.Calls`` cuts calls into microbatches and puts results back together).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Mapping

import torch
from torch import fx, nn

from harmony_fx.analysis.batch_dims import BatchAnalysis
from harmony_fx.analysis.reductions import ScalarReduction
from harmony_fx.compiler.host_memory import HostMemoryPlan
from harmony_fx.compiler.layout import Layout
from harmony_fx.compiler.packing import Candidate, update_groups
from harmony_fx.compiler.plan import Plan
from harmony_fx.compiler.shapes import Shapes
from harmony_fx.compiler.stages import StageLog
from harmony_fx.compiler.variants import Variant
from harmony_fx.config import CompileOptions
from harmony_fx.frontend.capture import Captured
from harmony_fx.ir.pack import Pack
from harmony_fx.lowering.tasks import ProgramSignature
from harmony_fx.passes.find_layers import Layer
from harmony_fx.planner.chain import Schedule
from harmony_fx.program.actions import Action, Key, KeyKind

__all__ = ["Compiled"]


@dataclasses.dataclass(frozen=True, kw_only=True)  # built by name: seventeen fields, several of one type
class Compiled:
    options: CompileOptions
    devices: tuple  # the runtime.devices.Device each program runs on
    trainer: bool   # the loss is in the graph; the last pack's forward and backward are one task
    updates: bool   # the host updates each pack's parameters as soon as they are complete
    schedule: Schedule | None  # the planner's choice, if it made one
    layout: Layout
    variants: Mapping[int | None, Variant]
    batch_analysis: BatchAnalysis
    flat_dims: tuple[int | None, ...]  # the batch dim of each captured input
    # each captured input of the example's first microbatch: (shape, dtype, requires grad)
    input_specs: tuple[tuple[torch.Size, torch.dtype, bool], ...]
    signature: ProgramSignature
    shapes: Shapes
    candidate: Candidate  # the packing chosen, lowered and estimated
    device_programs: tuple[dict[str, fx.GraphModule], ...]  # per device: {"forward": ..., "backward": ...}
    plan: Plan
    passes: StageLog
    host_memory: HostMemoryPlan | None = None  # host memory and the NVMe tier (Trainer(host_memory=, nvme_path=))
    resident_weights: bool = False  # the masters stay on the one device (``CompileOptions.resident_weights``)
    # how each scalar output reduces the whole batch in its own graph, where a number scales a loss
    # cut into microbatches (``loss.sum() / x.numel()``): what that number is at the batch's size
    batch_reductions: Mapping[str, ScalarReduction] | None = None
    # the whole batch's graph's output args, where the batch is cut: a number the model returns
    # (``x.shape[0]``) is the batch's, not a microbatch's
    batch_outputs: tuple | None = None

    def decisions(self) -> CompileOptions:
        """The options with this compile's decisions fixed (packs, microbatch counts, parallelism,
        forward groups, handoff): compiling another call shape with them plans nothing, it only
        lowers, verifies and checks the peak of this packing at the new shape."""
        layout = self.layout
        forward_groups = layout.forward_groups[1] if layout.forward_groups else None
        return dataclasses.replace(
            self.options, pack_boundaries=self.candidate.boundaries, forward_groups=forward_groups,
            microbatches=layout.num_microbatches, forward_microbatches=len(layout.forward_parts) or None,
            parallel=self.options.parallel if layout.parallel == "single" else layout.parallel,
            handoff=layout.handoff)

    # ------------------------------------------------------------------ read off the parts
    @property
    def primary(self) -> Variant:
        """The variant of the first microbatch's size (the one ``hm.captured`` shows)."""
        return self.variants[self.layout.mb_sizes[0]]

    @property
    def captured(self) -> Captured:
        return self.primary.captured

    @property
    def layers(self) -> tuple[Layer, ...]:
        return self.primary.layers

    @property
    def nodes(self) -> dict[str, fx.Node]:
        return self.primary.nodes

    @property
    def masters(self) -> Mapping[str, torch.Tensor]:
        return self.shapes.masters

    @property
    def packs_by_size(self) -> Mapping[int | None, list[Pack]]:
        return self.candidate.packs_by_size

    @property
    def packs(self) -> list[Pack]:
        return self.candidate.packs_by_size[self.layout.mb_sizes[0]]

    @property
    def device_actions(self) -> list[tuple[list[Action], list[Action]]]:
        return self.candidate.device_actions

    @property
    def task_memory(self) -> list[dict[tuple[str, int, int], tuple[int, int]]]:
        return [estimate.task_memory for estimate in self.candidate.estimates]

    @property
    def output_dims(self) -> Mapping[str, int | None]:
        """The dim each output's microbatches are joined along (an LSTM's output along dim 1, say), by
        this graph's output names: the analysis keys them by position, the same in the whole batch's
        graph and a sample's (where export may name a node otherwise: at one sample it drops a
        ``contiguous`` after a transpose, and the output is the ``transpose``)."""
        if not self.batch_analysis.separable:
            return {}
        dims = self.batch_analysis.output_dims
        outputs = self.captured.gm.graph.find_nodes(op="output")[0].args[0]
        return {arg.name: dims[position] for position, arg in enumerate(outputs)
                if isinstance(arg, fx.Node) and position in dims}

    @property
    def budget(self) -> int | None:
        return self.devices[0].budget

    @property
    def programs(self) -> dict[str, fx.GraphModule]:
        """The generated programs by name: ``forward``/``backward``, or ``host:1 forward``, ..."""
        if len(self.devices) == 1:
            return self.device_programs[0]
        return {f"{device.name} {phase}": program for device, programs in zip(self.devices, self.device_programs)
                for phase, program in programs.items()}

    def key_bytes(self, key: Key) -> int:
        """Bytes of a key as the plan counts them (from shapes and the graph's dtypes alone; a pack's
        optimizer state on the tier, from the host memory plan)."""
        if key.kind == KeyKind.STATE:
            return self.host_memory.pack_state_bytes[int(key.name[1:])] if self.host_memory is not None else 0
        return self.shapes.key_bytes(key, self.packs)

    def update_groups(self) -> dict[int, list[nn.Parameter]]:
        """``{pack index: the parameters the host updates after that pack's backward}``."""
        return update_groups(self.packs, self.masters)

    def written_buffers(self) -> list[torch.Tensor]:
        """The master buffers the forward writes back (BatchNorm statistics), each once."""
        buffers = {id(t): t for pack in self.packs for name in pack.mutated_buffers for t in [self.masters[name]]}
        return list(buffers.values())

    def trainable_params(self) -> list[nn.Parameter]:
        """The model's parameters that require grad, each once (tied ones are one); asked on every
        call, since a user may freeze some between calls."""
        return [param for param in self._distinct_params if param.requires_grad]

    @functools.cached_property
    def _distinct_params(self) -> tuple[nn.Parameter, ...]:
        return tuple({id(param): param for param in self.captured.params.values()}.values())
