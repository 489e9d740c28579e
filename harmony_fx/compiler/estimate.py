"""A device's static peak: its programs run on FakeTensors through the real executor's ops.

No formula: the forward and backward programs of one device run on a HostDevice that tracks memory
exactly as the runtime does (``ir.tracking``), with FakeTensors in place of every value, so the
peak it reaches is the peak the real run will reach (``runtime.probe``). Each compute task's net and
peak bytes are recorded on the way (the planner's memory profile), and the action after which the
device first holds its peak (what ``check_peak`` names).

With ``records`` (a compile's ``TaskRecords``), tasks whose kind the run has met before are
replayed from their record instead of run op by op (``compiler.replay``): the same bytes, in a
fraction of the time, for models whose packs repeat (a transformer's blocks). A replay that does
not leave the recorded bytes makes the run start again without replays.

With a ``cap`` the run stops as soon as the device would hold more: a search asking whether a
packing fits learns that it does not without running the rest of it (``complete=False``).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Mapping, Sequence

import torch
from torch._subclasses import FakeTensorMode
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

from harmony_fx.compiler.replay import ReplayingProbe, TaskRecords
from harmony_fx.compiler.shapes import Shapes, fake_like
from harmony_fx.ir.pack import Pack
from harmony_fx.lowering.tasks import ProgramSignature, grad_inputs
from harmony_fx.program.actions import Action, Key, KeyKind
from harmony_fx.program.codegen import run_actions
from harmony_fx.runtime.devices import DeviceOutOfMemoryError
from harmony_fx.runtime.host import HostState
from harmony_fx.runtime.probe import FakeHostDevice, Probe

__all__ = ["DeviceEstimate", "estimate_device"]


@dataclasses.dataclass(frozen=True)
class DeviceEstimate:
    peak: int
    # (kind, pack, microbatch) -> (net bytes, peak bytes above the start) of each compute task
    task_memory: dict[tuple[str, int, int], tuple[int, int]]
    # (index in forward + backward, action) after which the program first holds its peak
    peak_at: tuple[int, Action] | None
    complete: bool = True  # False: stopped at a cap it passed, ``peak`` is that cap plus one byte


def estimate_device(forward: Sequence[Action], backward: Sequence[Action], microbatches: Sequence[int],
                    packs_by_size: Mapping[int | None, Sequence[Pack]], shapes: Shapes, signature: ProgramSignature,
                    target: torch.device, records: TaskRecords | None = None, cap: int | None = None) -> DeviceEstimate:
    """Run one device's ``forward`` and ``backward`` programs (over its ``microbatches``) on
    FakeTensors placed on ``target``, the device the packs run on; ``records``: replay the tasks
    met before; ``cap``: stop where the device would hold more (see the module docstring)."""
    forward, backward = list(forward), list(backward)
    packs = packs_by_size[shapes.mb_sizes[0]]
    device = FakeHostDevice("fake", cap)
    programs = [functools.partial(run_actions, actions) for actions in (forward, backward)]
    with FakeTensorMode(allow_non_fake_inputs=True), torch.random.fork_rng(devices=[]):
        fake_masters = {name: fake_like(t, target) for name, t in shapes.masters.items()}
        arguments = ([packs_by_size[size] for size in shapes.mb_sizes], device, HostState.of(packs, fake_masters),
                     [grad_inputs(pack, signature) for pack in packs], lambda key: shapes.fake_value(key, target))
        options = dict(compute_dtype=shapes.compute_dtype, split_dims=shapes.split_dims,
                       keeps_last_graph=not signature.forward_only)
        probe = (Probe(*arguments, **options) if records is None
                 else ReplayingProbe(*arguments, records=records, target=target, **options))
        for mb in microbatches:
            for name in signature.model_inputs:
                key = Key(KeyKind.ACT, name, mb)
                probe.host_values[key] = shapes.fake_value(key, target)
            for name in signature.model_outputs:
                if name in signature.differentiable:
                    key = Key(KeyKind.GRAD, name, mb)
                    probe.host_values[key] = shapes.fake_value(key, target)
        try:
            probe.run_programs(programs)
        except DeviceOutOfMemoryError:
            if cap is None:
                raise
            return DeviceEstimate(cap + 1, {}, None, complete=False)
        except (DataDependentOutputException, DynamicOutputShapeException) as error:
            raise ValueError(
                f"planning runs every pack on FakeTensors (shapes, no values), and {device.context or 'a task'} "
                f"reads a tensor's values ({type(error).__name__}: {error}): most often a custom op whose backward "
                "calls .tolist() or .item() (transformers 5.17's grouped matmul for a mixture of experts, "
                "as in Mixtral), or a built-in op whose backward sizes a tensor by values (index_fill with a "
                "tensor value: its backward finds the unique indices). Give that code a fake implementation "
                "(torch.library.register_fake), keep its sizes fixed, or compute it outside the compiled "
                "model.") from error
        except RuntimeError as error:
            if shapes.mb_sizes != (None,):
                sizes = sorted(set(shapes.mb_sizes))
                error.add_note(
                    f"harmony_fx: raised running the packs on FakeTensors at microbatches of {sizes} "
                    "sample(s): a model that fails on a microbatch alone (a parameter or an input sized for the "
                    "whole batch, which some ops check only in their backward) fails here. Name each input's batch "
                    "dim (batch_dims=...), size what the model holds per sample, or pass microbatches=1.")
            raise
    if isinstance(probe, ReplayingProbe) and probe.replay_failed:
        return estimate_device(forward, backward, microbatches, packs_by_size, shapes, signature, target, cap=cap)
    peak = probe.peak
    first = next((i for i, seen in enumerate(probe.peak_after_action) if seen >= peak), None)
    actions = forward + backward
    return DeviceEstimate(peak, probe.task_memory, None if first is None else (first, actions[first]))

