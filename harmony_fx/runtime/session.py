"""Running a compiled model: one ``Session`` per ``Compiled``, one ``Iteration`` per call or step.

The session owns what lives across iterations: the host masters each pack's weight copies read
(``HostState``), the measured ``Stats`` of the last iteration, and one controller thread per device
(with several devices, so that no device waits for another's host-side work; with one, the caller's
thread issues the program). An iteration owns a ``Runtime`` per device, sharing the host side
(inputs, stash, host gradients).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import traceback
import weakref
from typing import Callable, Sequence

import torch
from torch import fx

from harmony_fx.ir import meta
from harmony_fx.ir.pack import Pack
from harmony_fx.lowering.tasks import grad_inputs
from harmony_fx.passes.retarget_device import packs_on
from harmony_fx.runtime.devices import DeviceOutOfMemoryError
from harmony_fx.program.actions import ActionKind, Key, KeyKind
from harmony_fx.runtime.executor import Runtime
from harmony_fx.runtime.host import GradientBuffers, HostState
from harmony_fx.runtime.inductor import PackCompiler
from harmony_fx.runtime.stats import Stats

__all__ = ["Session", "Iteration"]


class Iteration:
    """One iteration in flight: a runtime per device, sharing the host side (inputs, stash,
    gradients on the host)."""

    def __init__(self, runtimes: list[Runtime], controller: concurrent.futures.ThreadPoolExecutor | None) -> None:
        self.runtimes = runtimes
        self.controller = controller
        self.host_values = runtimes[0].host_values
        self.host_grads = runtimes[0].host_grads
        self.scalar_weights: dict[str, list[float]] = {}  # per scalar output: each microbatch's share
        # per joined output: each microbatch's part along its batch dim (x[mask]'s rows: not the input's)
        self.output_parts: dict[str, list[int]] = {}
        # the caller's inputs the backward reads again (a recompute's), as the forward read them; and
        # the parameters and buffers, as the forward's end left them (name, tensor, version)
        self.input_versions: dict[Key, int] = {}
        self.state_versions: list[tuple[str, torch.Tensor, int]] = []

    def run(self, programs: Sequence[Sequence[fx.GraphModule]]) -> None:
        """Run each device's programs, in order; the first error is raised once every device has
        stopped, and then nothing stays on any device."""

        def run_device(runtime: Runtime, device_programs: Sequence[fx.GraphModule]) -> None:
            runtime.device.bind_thread()
            try:
                for program in device_programs:
                    runtime.run(program)
            except BaseException as error:
                runtime.links.abort(error)  # no other device waits forever for this one
                raise

        errors: list[BaseException | None] = []
        try:
            if self.controller is None:
                run_device(self.runtimes[0], programs[0])
                return
            futures = [self.controller.submit(run_device, runtime, device_programs)
                       for runtime, device_programs in zip(self.runtimes, programs)]
            errors = [future.exception() for future in futures]
            # the error that stopped the iteration, not another device's "stopped by another device"
            root = self.runtimes[0].links.failed
            first = root if root in errors else next((error for error in errors if error is not None), None)
            if first is not None:
                raise first
        except BaseException as error:
            self.release()
            # The failed tasks' frames hold device tensors, and through the runtime (the links keep
            # the error) a cycle back to the error: clear them, so the device memory comes back now,
            # not when the garbage collector runs. The traceback keeps its lines, not its locals.
            for failed in {id(e): e for e in [error, *errors] if e is not None}.values():
                traceback.clear_frames(failed.__traceback__)
            raise

    def release(self) -> None:
        for runtime in self.runtimes:
            runtime.release()


class Session:
    """Runs the programs of ``compiled`` (a ``compiler.compiled.Compiled``, which it never changes).
    ``log``: where the stages compiling left to the first calls are added, the packs' inductor
    compiles (a ``compiler.stages.StageLog``: ``hm.passes`` shows it after the compile's own)."""

    def __init__(self, compiled, log) -> None:
        self.compiled = compiled
        self.log = log
        self.devices = compiled.devices
        self.host_state = HostState.of(compiled.packs, compiled.masters, compiled.resident_weights)
        if compiled.options.compute_dtype is None and any(d.torch_device.type == "cuda" for d in self.devices):
            _pin_in_place(compiled.masters.values())
        self.stats = Stats()
        self._controller: concurrent.futures.ThreadPoolExecutor | None = None
        # per device: the packs of each microbatch's size, making their tensors on that device
        first = self.devices[0].torch_device
        self._packs_for_mb: list[list[Sequence[Pack]]] = [
            [packs_on(compiled.packs_by_size[size], first, device.torch_device) for size in compiled.layout.sizes]
            for device in self.devices]
        self._grad_inputs = [grad_inputs(pack, compiled.signature) for pack in compiled.packs]
        inputs = set(compiled.captured.inputs)
        # the parameters and buffers packs read again in a recompute (not the buffers the forward
        # itself writes: BatchNorm's statistics in training, which a second call changes)
        captured, written = compiled.captured, {name for pack in compiled.packs for name in pack.mutated_buffers}
        state = {**captured.params, **{name: t for name, t in captured.buffers.items() if name not in written}}
        self._state = list({id(state[node.name]): (node.meta[meta.TARGET], state[node.name])
                             for node in captured.gm.graph.find_nodes(op="placeholder") if node.name in state}.values())
        self._inputs_read_again = {action.key for _, backward in compiled.device_actions for action in backward
                                   if action.kind == ActionKind.PREFETCH and action.key.kind == KeyKind.ACT
                                   and action.key.name in inputs}
        compile_packs = compiled.options.compile_packs
        if compile_packs is None:
            compile_packs = all(device.torch_device.type == "cuda" for device in self.devices)
        self.pack_compiler = PackCompiler() if compile_packs else None
        self.recording = False  # the timeline (``HarmonyModule.record_timeline``)
        self._graphs_logged, self._seconds_logged = 0, 0.0  # compiles already in ``log``
        # calls whose forward ran and whose backward has not: each holds its last pack on the device
        self._waiting: weakref.WeakSet[Iteration] = weakref.WeakSet()

    def begin(self, per_mb: Sequence[Sequence[torch.Tensor]], on_update: Callable[[Runtime, int, Sequence], None] | None = None,
              output_grads: dict[Key, torch.Tensor] | None = None, on_tier: Callable | None = None,
              grad_buffers: GradientBuffers | None = None) -> Iteration:
        """A new iteration over the microbatches' flat inputs ``per_mb`` (nothing run yet);
        ``grad_buffers``: where weight gradients land (``Runtime``)."""
        compiled = self.compiled
        self.stats = Stats(budget={device.name: device.budget for device in self.devices}, recording=self.recording)
        runtimes: list[Runtime] = []
        for device in self.devices:
            device.reset_peak()
            device.planned_peak = compiled.plan.predicted_peak.get(device.name)  # named if it runs out of memory
            runtimes.append(Runtime(self._packs_for_mb[len(runtimes)], device, self.host_state, self._grad_inputs, self.stats,
                                    on_update=on_update, compute_dtype=compiled.options.compute_dtype,
                                    shared=runtimes[0] if runtimes else None, index=len(runtimes),
                                    compiler=self.pack_compiler, split_dims=compiled.shapes.split_dims,
                                    on_tier=on_tier, keeps_last_graph=not compiled.signature.forward_only,
                                    grad_buffers=grad_buffers))
        iteration = Iteration(runtimes, self._controller_threads())
        layout = compiled.layout
        joined = [_join(compiled.flat_dims, [per_mb[j] for j in parts]) for parts in layout.forward_parts]
        for mb, flat in enumerate([*per_mb, *joined]):  # the larger forward microbatches after the backward's
            for name, value in zip(compiled.captured.inputs, flat):
                key = Key(KeyKind.ACT, name, mb)
                iteration.host_values[key] = value.detach()  # the caller's tensor, not a copy
                if key in self._inputs_read_again:
                    iteration.input_versions[key] = value._version
        iteration.host_values.update(output_grads or {})
        return iteration

    def start(self, per_mb: Sequence[Sequence[torch.Tensor]], on_update: Callable[[Runtime, int, Sequence], None] | None = None,
              output_grads: dict[Key, torch.Tensor] | None = None) -> Iteration:
        """Run the forward programs (one per device, side by side); the returned iteration holds
        what the backward programs need."""
        iteration = self.begin(per_mb, on_update, output_grads)
        # a HostDevice hands its staged weights to the packs (whether it does changes with record_timeline's
        # tracking): another call's kept graph may hold them
        sharing = [device for device in self.devices if getattr(device, "shares_host_memory", False)]
        for device in sharing:
            device.staging.fresh = bool(self._waiting)
        try:
            with self._noting_calls_waiting(iteration):
                iteration.run([[programs["forward"]] for programs in self.compiled.device_programs])
        finally:
            for device in sharing:
                device.staging.fresh = False
        if not self.compiled.signature.forward_only:
            self._waiting.add(iteration)
            iteration.state_versions = [(name, tensor, tensor._version) for name, tensor in self._state]
        return iteration

    def finish(self, iteration: Iteration) -> None:
        """Run the backward programs (output gradients already in ``iteration.host_values``)."""
        try:
            _refuse_inputs_changed_since_the_forward(iteration)
            with self._noting_calls_waiting(iteration):
                iteration.run([[programs["backward"]] for programs in self.compiled.device_programs])
        finally:
            self._waiting.discard(iteration)
            iteration.release()
        self.finish_stats(iteration_ended=True)

    @contextlib.contextmanager
    def _noting_calls_waiting(self, iteration: Iteration):
        """An out-of-memory error while other calls' forwards wait for their backward says so: each
        keeps its last pack's weights and graph on the device, which the plan (one call at a time)
        does not count."""
        try:
            yield
        except DeviceOutOfMemoryError as error:
            others = [waiting for waiting in self._waiting if waiting is not iteration]
            if others:
                error.add_note(f"harmony_fx: {len(others)} other call(s) of this module wait for their backward, each "
                               "keeping its last pack's weights and graph on the device; the plan counts one call "
                               "at a time. Call backward before the next call where you can; for a loss of several "
                               "calls (a siamese pair), pass their inputs as one batch in one call and split its "
                               "output, or give a budget with room for each call's last pack.")
            raise

    def run_iteration(self, per_mb: Sequence[Sequence[torch.Tensor]], on_update: Callable[[Runtime, int, Sequence], None],
                      output_grads: dict[Key, torch.Tensor], on_tier: Callable | None = None,
                      grad_buffers: GradientBuffers | None = None) -> Iteration:
        """Forward and backward in one go (the Trainer): each device runs its backward program as
        soon as its forward program ends, with no barrier between them (a pipeline's fused last task
        hands gradients to a device that is already in its backward). ``on_tier``: the NVMe tier's
        reads and writes; ``grad_buffers``: where weight gradients land (``Runtime``)."""
        iteration = self.begin(per_mb, on_update, output_grads, on_tier, grad_buffers)
        try:
            iteration.run([[programs["forward"], programs["backward"]] for programs in self.compiled.device_programs])
        finally:
            iteration.release()
        self.finish_stats(iteration_ended=True)
        return iteration

    def finish_stats(self, iteration_ended: bool = False) -> None:
        compiler = self.pack_compiler
        if compiler is not None and iteration_ended:
            compiler.end_iteration()
        if compiler is not None and compiler.graphs > self._graphs_logged:
            new, self._graphs_logged = compiler.graphs - self._graphs_logged, compiler.graphs
            self.log.add("compile packs (inductor)", compiler.compile_seconds - self._seconds_logged,
                         f"{new} graph(s) on the first calls; {compiler.structures} distinct pack "
                         f"structure(s) for {len(self.compiled.packs)} packs")
            self._seconds_logged = compiler.compile_seconds
        for device in self.devices:
            if device.counts_memory:  # an untracked HostDevice counts nothing: no peak, rather than 0
                self.stats.peak_bytes[device.name] = device.peak_bytes()
                self.stats.memory_peaks[device.name] = device.memory_peaks()
            self.stats.pinned_bytes[device.name] = device.pinned_bytes()

    def close(self) -> None:
        """Stop the devices' stream threads (chaos mode) and the controller threads."""
        for device in self.devices:
            device.streams.close()
        if self._controller is not None:
            self._controller.shutdown(wait=True)
            self._controller = None

    def _controller_threads(self) -> concurrent.futures.ThreadPoolExecutor | None:
        if len(self.devices) == 1:
            return None
        if self._controller is None:
            self._controller = concurrent.futures.ThreadPoolExecutor(len(self.devices), "harmony-device")
        return self._controller


def _join(flat_dims: Sequence[int | None], parts: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """The flat inputs of a forward microbatch made of the backward microbatches ``parts``: each
    batched input concatenated along its batch dim, each shared one as it is."""
    return [torch.cat([part[i] for part in parts], dim) if dim is not None else parts[0][i]
            for i, dim in enumerate(flat_dims)]


def _pin_in_place(masters) -> None:
    """Masters in pinned memory, once: each weight copy then reads them directly (fp32 compute;
    under bf16 a device keeps a pinned compute-dtype copy instead, ``CudaDevice.stage``). The
    tensors stay the model's own: their ``.data`` moves, so optimizers and tied weights see the same
    objects."""
    for master in masters:
        if master.device.type == "cpu" and not master.is_pinned():
            master.data = master.data.pin_memory()


def _refuse_inputs_changed_since_the_forward(iteration: Iteration) -> None:
    """The backward recomputes packs from the caller's own input tensors (kept, not copied: inputs
    may be large) and the model's parameters and buffers, as ``torch.utils.checkpoint`` does; one
    changed in place since the forward (``x.div_(255)``, an optimizer step or an EMA update between
    the call and ``backward()``) would give gradients of another function. Refused as autograd
    refuses a saved tensor changed in place."""
    for name, tensor, version in iteration.state_versions:
        if tensor._version != version:
            raise RuntimeError(
                f"harmony_fx: the model's '{name}' was modified by an in-place operation after the forward (its "
                f"version {version} is now {tensor._version}), and the backward recomputes packs from it: harmony_fx "
                "recomputes each pack from the parameters and buffers, as torch.utils.checkpoint does. Change them "
                "(an optimizer step, an EMA, a clamp, an annealed buffer) after backward().")
    for key, version in iteration.input_versions.items():
        now = iteration.host_values[key]._version
        if now != version:
            raise RuntimeError(
                f"harmony_fx: the model's input '{key.name}' was modified by an in-place operation after the "
                f"forward (its version {version} is now {now}), and the backward reads it again: harmony_fx "
                "recomputes each pack from its inputs, as torch.utils.checkpoint does. Change a copy "
                f"({key.name} = {key.name}.clone() before changing it), or change it after backward().")
