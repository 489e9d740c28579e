"""Search: pack boundaries, microbatches, data- or pipeline-parallel, and how many devices; and the
forward's own packs and microbatches (Harmony's four: Ufwd, Pfwd, Ubwd, Pbwd).

1. **Packs, exactly.** For one (microbatch size, mode, devices) the boundaries come from a dynamic
   program over contiguous layer ranges. A pack's cost is ``max(compute, transfers, forward +
   tier)``: its copies overlap its compute, and the NVMe tier's read and write of the pack's share
   of the state (``planner.host_memory.tier_share``) overlap its recompute and backward, around its
   update (the tier is one lane: where it binds, the packs' shares add up to the iteration). The
   memory constraint is the one the runtime meets: a pack's own need plus the weights of the
   neighbour being prefetched meanwhile (forward: the next pack, backward: the previous one), for
   every adjacent pair. The state is the last pack ``[i, j)``; for a next
   pack ``[j, k)`` the feasible ``i`` form a suffix (a smaller last pack needs less), so a suffix
   minimum makes each transition O(log L): O(L² log L) in all, exact for this cost model.
2. **Everything else, by simulation.** Each (microbatches, mode, devices) is ranked by the dynamic
   program's estimate; the best few are lowered and simulated (``planner.simulate``), and the
   baselines (one layer per pack, the largest packs that fit, Harmony's greedy and balanced-time
   packings) are simulated for the winner too.
3. **The forward apart.** Over the winner's backward packs (Pbwd) and microbatches (Ubwd), the
   forward's packs (Pfwd: groups of backward packs) come from a second exact dynamic program
   (``forward_groups``), once for the backward's microbatch size and once for each larger forward
   microbatch size (Ufwd: 2, 4, 8, ... backward microbatches each, until one fits neither way or
   is no faster than the one before); each grouping, and the backward's own packs at each forward
   size, is simulated. Pbwd is not chosen again for each Ufwd: the search is exact for each part
   given the ones before it, and the simulator decides between them. A pipeline is simulated
   handing its values on through the host too (``ProgramSignature.handoff``). The fastest
   simulated schedule whose simulated peak fits the budget, and whose stash fits host memory
   (less what an NVMe tier takes, ``planner.host_memory``), is the choice.
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import Callable, Sequence

import numpy as np

from harmony_fx.config import format_size
from harmony_fx.planner.chain import Schedule, chain_schedule
from harmony_fx.planner.costs import layer_seconds
from harmony_fx.planner.profile import ModelProfile
from harmony_fx.planner.simulate import Simulation, simulate
from harmony_fx.planner.specs import DeviceSpec, HostSpec
from harmony_fx.planner.host_memory import MASTER_AND_GRAD_BYTES, TierShare, plan_host_memory, tier_share

__all__ = ["PlanChoice", "search", "best_boundaries", "baselines", "lower_bound", "host_bytes",
           "PlanningError", "PackModel", "ForwardModel", "BOUND_TERMS"]


class PlanningError(ValueError):
    """No schedule fits the device or host memory. ``closest``: where schedules were simulated and
    none fit the device, those simulated, the lowest peak first (the estimate of a peak is meant to
    stay above the exact count, so a caller that counts exactly may still find one fits)."""

    def __init__(self, message: str, closest: Sequence[tuple[Schedule, int]] = ()) -> None:
        super().__init__(message)
        self.closest = tuple(closest)  # (schedule, its simulated peak)


@dataclasses.dataclass
class PlanChoice:
    schedule: Schedule
    policy: str
    simulation: Simulation
    batch_size: int
    compared: dict[str, float]          # packing policy -> simulated seconds, for the chosen settings
    lower_bound: float
    bound: str                          # which term of the lower bound binds: one of ``BOUND_TERMS``
    host_bytes: int

    @property
    def seconds(self) -> float:
        return self.simulation.seconds

    def samples_per_second(self) -> float:
        return self.batch_size / self.seconds


def _prefix(values: Sequence[float]) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(np.asarray(values, dtype=np.float64))])


class PackModel:
    """Need and cost of packs ``[a, b)`` for one setting, from prefix sums: every method takes
    ints or numpy arrays of them (broadcast), so the dynamic program works a row at a time.
    ``tier``: each pack's share of the NVMe tier (``planner.host_memory.tier_share``);
    ``fuse_last``: as ``Schedule.fuse_last`` (False: the last pack holds every microbatch's graph)."""

    def __init__(self, profile: ModelProfile, size: int, mbs_per_device: int, spec: DeviceSpec,
                 devices_sharing_link: int, host: HostSpec, tier: TierShare = TierShare(),
                 fuse_last: bool = True) -> None:
        layers = profile.layers
        self.num_layers = len(layers)
        self.mbs = mbs_per_device
        self.fuse_last = fuse_last
        bandwidth = spec.host_bandwidth
        if host.link_bandwidth is not None:
            bandwidth = min(bandwidth, host.link_bandwidth / devices_sharing_link)
        self.bandwidth = bandwidth
        self.overhead = 10 * spec.launch_seconds * mbs_per_device
        self.update_rate = host.update_params_per_second
        seconds = [layer_seconds(layer, size, spec, profile.precision, launch=False) for layer in layers]
        # a task's fixed cost, once per task whatever its layers (``PackCosts.compute_seconds``)
        self.launch = 0.0 if any(layer.seconds for layer in layers) else spec.launch_seconds
        self.forward = _prefix([fwd for fwd, _ in seconds])
        self.backward = _prefix([bwd for _, bwd in seconds])
        self.params = _prefix([layer.num_params for layer in layers])
        self._weights = _prefix([layer.param_bytes for layer in layers])
        self._grads = _prefix([4 * layer.num_params for layer in layers])  # summed and copied in fp32
        self._saved = _prefix([layer.saved_bytes * size for layer in layers])
        self._saved_inputs = _prefix([layer.saved_input_bytes * size for layer in layers])
        inputs = np.asarray([profile.input_bytes] + [layer.out_bytes for layer in layers], dtype=np.float64)
        self.boundary = inputs * size
        # the tier's bytes for a pack: its parameters' share and its input's (its stash), each read
        # before the pack's update and written after it, one after the other on the tier's lane
        self._tier_inputs = tier.per_input_byte * inputs
        self._tier_per_param = tier.per_param
        self._read, self._write = 1 / host.nvme_read, 1 / host.nvme_write
        self.tiered = bool(tier.per_param or tier.per_input_byte)
        # after the first microbatch, a backward's weight gradients are added into the pack's: each
        # layer's are working memory then (``PackCosts.task_peak``)
        accumulating = mbs_per_device > 1
        self._backward_work = _RangeMax([layer.backward_work_bytes * size + (layer.param_bytes if accumulating else 0)
                                         for layer in layers])
        self._forward_work = _RangeMax([layer.forward_work_bytes * size for layer in layers])

    def biggest(self, a, b):
        """The largest working set of a backward over one of the layers ``[a, b)``."""
        return self._backward_work(a, b)

    def biggest_forward(self, a, b):
        """The largest working set of a forward over one of the layers ``[a, b)``."""
        return self._forward_work(a, b)

    def graph(self, a, b):
        """The autograd graph of one microbatch over ``[a, b)`` (``costs.graph_bytes``)."""
        return self._saved[b] - self._saved[a] + np.minimum(self.boundary[a], self._saved_inputs[b] - self._saved_inputs[a])

    def weights(self, a, b):
        return self._weights[b] - self._weights[a]

    def grads(self, a, b):
        return self._grads[b] - self._grads[a]

    def need(self, a, b):
        """Bytes a pack holds in its backward: weights and their gradients, one microbatch's graph
        (the last pack unfused: every microbatch's, kept from the forward), its input and output
        values and gradients, and the largest layer's working set."""
        io = 2 * (self.boundary[a] + self.boundary[b])
        graphs = 1 if self.fuse_last else np.where(np.asarray(b) == self.num_layers, self.mbs, 1)
        return self.weights(a, b) + self.grads(a, b) + graphs * self.graph(a, b) + io + self.biggest(a, b)

    def tier_bytes(self, a, b):
        return self._tier_per_param * (self.params[b] - self.params[a]) + self._tier_inputs[a]

    def io(self, a, b):
        """Seconds the tier's lane spends on the pack within the iteration: its share read, then
        written; the first pack's write, the last of the iteration, goes on into the next one's
        forward, where the lane has nothing else to do."""
        return self.tier_bytes(a, b) * (self._read + np.where(np.asarray(a) == 0, 0.0, self._write))

    def lane(self, a, b):
        """What a pack takes of the tier's one lane, the iteration's at least: its share read and
        written after its forward (before it, the lane has nothing of the pack's to do); 0 without
        a tier."""
        if not self.tiered:
            return np.zeros(np.broadcast(np.asarray(a), np.asarray(b)).shape)
        return self.mbs * (self.forward[b] - self.forward[a]) + self.io(a, b)

    def exposed(self, a, b):
        """What the first pack adds that nothing overlaps: its weights' first copy in, and its
        update, the last of the iteration."""
        return self.weights(a, b) / self.bandwidth + (self.params[b] - self.params[a]) / self.update_rate

    def cost(self, a, b):
        # forward, recompute and backward; the last pack keeps its graph and skips the recompute
        runs = np.where(np.asarray(b) == self.num_layers, 1, 2)
        compute = self.mbs * (runs * (self.forward[b] - self.forward[a] + self.launch)
                              + (self.backward[b] - self.backward[a] + self.launch))
        moved = 2 * self.weights(a, b) + self.grads(a, b) + 2 * self.mbs * (self.boundary[a] + self.boundary[b])
        # the host updates the pack after its backward, while the packs before it run theirs: what
        # their backward cannot cover is exposed
        update = (self.params[b] - self.params[a]) / self.update_rate
        tail = np.maximum(0.0, update - self.mbs * (self.forward[a] + self.backward[a]))
        # every pack adds synchronisation (waits, event records, a pipeline hand-off per microbatch);
        # the tier reads and writes a pack's state around its update, in the backward: its lane can
        # overlap the pack's recompute and backward, not its forward (``lane``)
        return np.maximum(np.maximum(compute, moved / self.bandwidth), self.lane(a, b)) + tail + self.overhead


class _RangeMax:
    """The maximum of ``values[a:b]`` in O(1), ``a``, ``b`` ints or arrays of them: a sparse table,
    level l holding the maxima of 2**l values."""

    def __init__(self, values: Sequence[float]) -> None:
        levels = [np.asarray(values, dtype=np.float64)]
        while 2 ** len(levels) <= len(values):
            prev, width = levels[-1], 2 ** (len(levels) - 1)
            levels.append(np.maximum(prev[:-width], prev[width:]))
        self._table = np.full((len(levels), len(values)), -np.inf)
        for level, row in enumerate(levels):
            self._table[level, :len(row)] = row

    def __call__(self, a, b):
        level = np.log2(np.asarray(b) - np.asarray(a)).astype(int)
        return np.maximum(self._table[level, a], self._table[level, np.asarray(b) - (1 << level)])


class ForwardModel:
    """Groups ``[u, v)`` of the backward's packs ``boundaries`` run as one forward pack: it holds
    its weights, one layer's values and its edges (no graph, no gradients), beside the next
    group's weights coming in; it costs the slower of its forward and its weights' copy."""

    def __init__(self, model: PackModel, boundaries: Sequence[int]) -> None:
        self.model = model
        self.edges = np.asarray([*boundaries, model.num_layers])
        self.num_layers = len(boundaries) - 1  # the last pack stays alone: it keeps its graph

    def weights(self, u, v):
        return self.model.weights(self.edges[u], self.edges[v])

    def need(self, u, v):
        model, a, b = self.model, self.edges[u], self.edges[v]
        return self.weights(u, v) + model.biggest_forward(a, b) + 2 * (model.boundary[a] + model.boundary[b])

    def exposed(self, u, v):
        return self.weights(u, v) / self.model.bandwidth

    def cost(self, u, v):
        model, a, b = self.model, self.edges[u], self.edges[v]
        compute = model.mbs * (model.forward[b] - model.forward[a] + model.launch)
        return np.maximum(compute, self.weights(u, v) / model.bandwidth) + model.overhead


def forward_groups(model: PackModel, boundaries: Sequence[int], budget: float) -> tuple[int, ...]:
    """The exact best grouping of the backward's packs into forward packs (the last one alone), as
    ``ProgramSignature.forward_groups``; () when no grouping beats one pack per group."""
    if len(boundaries) < 3:
        return ()
    forward = ForwardModel(model, boundaries)
    groups = best_boundaries(forward.num_layers, forward, budget)
    if groups is None or len(groups) == forward.num_layers:
        return ()
    return (*groups, len(boundaries) - 1)


def best_boundaries(num_layers: int, model: PackModel, budget: float) -> list[int] | None:
    """The exact optimum of ``sum(cost)`` over contiguous packings whose adjacent pairs fit.

    ``best[j]``: for each last pack ``[i, j)`` of a cover of ``[0, j)``, its cheapest cost. For a
    next pack ``[j, k)`` every ``i`` is checked (a pack's ``need`` is not monotone: one that ends
    past a loss no longer holds the logits), as one matrix over (i, k) per ``j``; the ``k`` stop
    where even the next pack's weights and gradients no longer fit beside the smallest last pack.
    """
    best: list[dict[int, float]] = [dict() for _ in range(num_layers + 1)]
    parent: dict[tuple[int, int], int] = {}
    ks = np.arange(1, num_layers + 1)
    first = model.cost(0, ks) + model.exposed(0, ks)
    for k, fits, value in zip(ks, model.need(0, ks) <= budget, first):
        if fits:
            best[k][0] = float(value)
    for j in range(1, num_layers):
        if not best[j]:
            continue
        starts = np.fromiter(best[j], dtype=int)
        values = np.fromiter(best[j].values(), dtype=np.float64)
        last_weights, last_need = model.weights(starts, j), model.need(starts, j)
        ks = np.arange(j + 1, num_layers + 1)
        next_weights = model.weights(j, ks)
        ks = ks[2 * next_weights + last_weights.min() <= budget]  # need >= 2 * weights, which only grow
        if not len(ks):
            continue
        next_need, next_weights = model.need(j, ks), model.weights(j, ks)
        fits = ((last_weights[:, None] <= budget - next_need[None, :])
                & (last_need[:, None] <= budget - next_weights[None, :]))
        candidates = np.where(fits, values[:, None], np.inf)
        chosen = candidates.argmin(axis=0)
        totals = candidates[chosen, np.arange(len(ks))] + model.cost(j, ks)
        for k, i, total in zip(ks, starts[chosen], totals):
            if total < best[k].get(j, np.inf):
                best[k][j] = float(total)
                parent[(j, int(k))] = int(i)
    if not best[num_layers]:
        return None
    i = min(best[num_layers], key=best[num_layers].get)
    boundaries, j = [], num_layers
    while True:
        boundaries.append(i)
        if i == 0:
            return boundaries[::-1]
        i, j = parent[(i, j)], i


def baselines(num_layers: int, model: PackModel, budget: float) -> dict[str, list[int]]:
    """Packings to beat: one layer per pack, the largest packs that fit (front to back), Harmony's
    ``greedy_reverse`` (back to front, the rest in the first pack) and ``balanced_time``."""
    fits = lambda a, b: model.need(a, b) + model.weights(a, b) <= budget  # noqa: E731 - with a neighbour as big
    result = {"one layer per pack": list(range(num_layers))}
    largest, a = [], 0
    while a < num_layers:
        b = a + 1
        while b < num_layers and fits(a, b + 1):
            b += 1
        largest.append(a)
        a = b
    result["largest packs"] = largest
    starts, b = [], num_layers
    while b > 0:
        a = b - 1
        while a > 0 and fits(a - 1, b):
            a -= 1
        starts.append(a)
        b = a
    result["harmony greedy"] = starts[::-1]
    seconds = list(model.forward + model.backward)
    for count in range(1, num_layers + 1):  # fewest equal-time chunks that all fit
        cuts = [0] + [bisect.bisect_left(seconds, seconds[-1] * c / count) for c in range(1, count)]
        cuts = sorted(set(min(max(c, 0), num_layers - 1) for c in cuts))
        ends = [*cuts[1:], num_layers]
        if all(fits(a, b) for a, b in zip(cuts, ends)):
            result["harmony balanced-time"] = cuts
            break
    return result


def host_bytes(profile: ModelProfile, boundaries: Sequence[int], batch_size: int, host: HostSpec) -> int:
    """Host memory one iteration holds: fp32 masters and gradients, the optimizer's state, and the
    stash (every pack's inputs, for every sample), less what an NVMe tier takes (``planner.host_memory``)."""
    return plan_host_memory(profile, boundaries, batch_size, host).host_bytes


BOUND_TERMS = ("compute", "bus", "host optimizer", "tier")


def lower_bound(profile: ModelProfile, batch_size: int, devices: int, spec: DeviceSpec, host: HostSpec,
                recomputed: Sequence[int] = (), tier_bytes: int = 0) -> tuple[float, str]:
    """The longest of what every iteration must do on one resource, and its name (one of
    ``BOUND_TERMS``): a bound on any schedule that recomputes the layers ``recomputed`` and keeps
    ``tier_bytes`` on the NVMe tier, whatever its overlap.

    * compute: forward and backward of every layer, and the forward again of those recomputed,
      spread over every device at once;
    * bus: each device's share of the weights in twice and their gradients out once over its own
      link, and all of it over the shared host link;
    * host optimizer: every parameter updated by the host's workers (on each server its share,
      where the optimizer is sharded over servers);
    * tier: ``tier_bytes`` read and written back on the tier's one lane."""
    compute = 0.0
    for index, layer in enumerate(profile.layers):  # without a task's fixed cost: a bound on any packing
        forward, backward = layer_seconds(layer, batch_size, spec, profile.precision, launch=False)
        compute += forward + backward + (forward if index in recomputed else 0.0)
    compute /= devices
    moved = 2 * profile.param_bytes + 4 * profile.num_params  # weights in twice, fp32 gradients out
    transfer = moved / spec.host_bandwidth  # data-parallel: every device; pipeline: 1/N each, but N links
    if devices > 1:
        transfer = min(transfer, moved / devices / spec.host_bandwidth)
    if host.link_bandwidth is not None:
        transfer = max(transfer, moved / host.link_bandwidth)
    cluster = host.cluster
    shards = cluster.nodes if cluster.nodes > 1 and cluster.shard_optimizer else 1
    updates = profile.num_params / (host.update_params_per_second * host.update_workers * shards)
    tier = tier_bytes / host.nvme_read + tier_bytes / host.nvme_write
    terms = dict(zip(BOUND_TERMS, (compute, transfer, updates, tier)))
    binding = max(terms, key=terms.get)  # the first of equals: compute before the others
    return terms[binding], binding


def _settings(batch_size: int, max_devices: int, parallel: str | None, microbatches: int | None, all_devices: bool):
    device_counts = [max_devices] if all_devices else sorted({1, max_devices} | {d for d in (2, 4, 8, 16, 32)
                                                                                 if d < max_devices})
    for devices in device_counts:
        modes = ["single"] if devices == 1 else ["dp", "pp"]
        for mode in modes:
            if parallel not in (None, "auto") and mode != parallel and not (parallel == "single" and devices == 1):
                continue
            counts = [microbatches] if microbatches else sorted(
                {batch_size // size for size in _powers_of_two(batch_size)} | {devices})
            for count in counts:
                # data parallelism needs a microbatch per device; a pipeline's devices take turns on each
                if (count >= devices or mode == "pp") and count <= batch_size:
                    yield count, mode, devices


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


def search(profile: ModelProfile, spec: DeviceSpec, host: HostSpec, *, batch_size: int, devices: int = 1,
           budget: int | None = None, parallel: str | None = None, microbatches: int | None = None,
           simulate_top: int = 6, all_devices: bool = False, forward_apart: bool = True,
           handoff: str | None = None, fuse_last: bool = True,
           progress: Callable[[str], None] | None = None) -> PlanChoice:
    """The fastest simulated schedule; ``all_devices``: use every device (else also fewer);
    ``forward_apart``: the forward may run larger microbatches than the backward (the samples
    are apart and no pack draws random numbers); ``handoff``: a pipeline's, fixed (``None``: the
    simulator chooses between device to device and through the host); ``fuse_last``: the loss is
    in the graph (a Trainer; False: ``compile``'s module, whose last pack keeps every
    microbatch's graph for the caller's backward: ``Schedule.fuse_last``)."""
    given, budget = budget or spec.memory, spec.usable(budget)
    num_layers = len(profile.layers)
    # the least any packing needs: no stash, and with a tier, one layer per pack (the smallest
    # staging buffers)
    least = plan_host_memory(profile, range(num_layers) if host.nvme_bytes else [], 0, host)
    fixed = least.host_bytes
    if host.memory is not None and fixed > host.memory:
        tier = f" with {format_size(least.nvme_bytes)} of it on the NVMe tier" if host.nvme_bytes else ""
        per_param = MASTER_AND_GRAD_BYTES + host.optimizer_state_bytes + (2 if profile.precision == "bf16" else 0)
        raise PlanningError(
            f"search: {profile.name} needs at least {format_size(fixed)} of host memory for its fp32 masters, "
            f"{'bf16 weight copies, ' if profile.precision == 'bf16' else ''}gradients and optimizer state "
            f"({per_param} bytes per parameter, {profile.num_params / 1e9:.1f}B parameters){tier}, more than the "
            f"{format_size(host.memory)} given. Use "
            "a host with more memory, an NVMe tier (--nvme), or an optimizer with less state.")
    ranked = []
    smallest_need = float("inf")
    shares: dict[int, TierShare] = {}  # by the devices whose programs stage the tier's state
    for count, mode, used in _settings(batch_size, devices, parallel, microbatches, all_devices):
        size = -(-batch_size // count)
        per_device = count if mode == "pp" else -(-count // used)
        stagers = used if mode == "pp" else 1
        if stagers not in shares:
            shares[stagers] = tier_share(profile, batch_size, host, stagers)
        model = PackModel(profile, size, per_device, spec, used, host, shares[stagers], fuse_last)
        smallest_need = min(smallest_need, min(model.need(i, i + 1) + model.weights(i, i + 1) for i in range(num_layers)))
        boundaries = best_boundaries(num_layers, model, budget)
        if boundaries is None:
            continue
        packs = list(zip(boundaries, [*boundaries[1:], num_layers]))
        estimate = model.exposed(*packs[0]) + sum(model.cost(a, b) for a, b in packs)
        if mode == "pp":  # its devices run packs at once; the tier's one lane serves them all
            estimate = max(estimate / used, sum(model.lane(a, b) for a, b in packs))
        ranked.append((estimate, count, mode, used, boundaries, model))
    if not ranked:
        raise PlanningError(
            f"search: no packing of {profile.name} fits a device budget of {format_size(given)}"
            + (f" ({format_size(budget)} after the GPU allocator's reserve)" if budget != given else "")
            + "; one layer at "
            f"one sample per microbatch needs {format_size(smallest_need)}. Use a device with more memory, or "
            "a smaller batch or sequence.")
    ranked.sort(key=lambda r: r[0])
    simulated = []
    for index, (_, count, mode, used, boundaries, model) in enumerate(ranked[:simulate_top]):
        schedule = Schedule(tuple(boundaries), count, mode, used, handoff=handoff or "peer", fuse_last=fuse_last)
        if progress:
            progress(f"simulating {schedule.describe()} ({index + 1}/{min(simulate_top, len(ranked))})")
        simulated.append((_simulate(profile, schedule, batch_size, spec, host), schedule, model))
    fitting = [entry for entry in simulated if max(entry[0].peak_bytes) <= budget]
    if not fitting:
        closest = sorted(((schedule, max(simulation.peak_bytes)) for simulation, schedule, _ in simulated),
                         key=lambda entry: entry[1])
        schedule, peak = closest[0]
        raise PlanningError(
            f"search: every simulated schedule of {profile.name} exceeds the device budget of {format_size(budget)}; "
            f"the closest, {schedule.describe()}, peaks at {format_size(peak)}. "
            "Use a device with more memory, or a smaller batch or sequence.", closest)
    simulation, schedule, model = min(fitting, key=lambda entry: entry[0].seconds)
    # the baselines, for the chosen settings: keep whichever is fastest (and say which)
    results = {"dynamic programming": (simulation, schedule)}
    for policy, cuts in baselines(num_layers, model, budget).items():
        candidate = dataclasses.replace(schedule, boundaries=tuple(cuts))
        same = next((found for found in results.values() if found[1] == candidate), None)
        if same is None and progress:
            progress(f"simulating the {policy} baseline")
        # a baseline that is a packing simulated already (largest packs and Harmony's greedy often
        # are the same) is not simulated again
        results[policy] = same or (_simulate(profile, candidate, batch_size, spec, host), candidate)
    # the forward apart from the backward (Harmony's Pfwd and Ufwd), if the simulator says it helps
    chosen = min(results, key=lambda policy: results[policy][0].seconds
                 if max(results[policy][0].peak_bytes) <= budget else float("inf"))
    base = results[chosen][1]
    previous = results[chosen][0].seconds
    for forward_count in _forward_counts(base, forward_apart):
        forward_model = model if forward_count is None else PackModel(
            profile, -(-batch_size // forward_count),
            forward_count if base.parallel == "pp" else -(-forward_count // base.devices), spec, base.devices, host,
            fuse_last=fuse_last)
        grouped = forward_groups(forward_model, list(base.boundaries), budget)
        fits, fastest = False, float("inf")
        # the grouping the dynamic program prefers, and the backward's own packs (its cost model
        # does not see the simulator's overlap: both are simulated)
        for groups in dict.fromkeys([grouped, ()]):
            if forward_count is None and not groups:
                continue  # the backward's packs and microbatches: simulated already
            candidate = dataclasses.replace(base, forward_groups=groups, forward_microbatches=forward_count)
            what = ", ".join(filter(None, [f"{len(groups)} packs" if groups else "",
                                           f"{forward_count} microbatches" if forward_count else ""]))
            if progress:
                progress(f"simulating a forward of {what} over the {chosen} packing")
            simulation = _simulate(profile, candidate, batch_size, spec, host)
            results[f"{chosen} + forward of {what}"] = (simulation, candidate)
            fits = fits or max(simulation.peak_bytes) <= budget
            fastest = min(fastest, simulation.seconds)
        if forward_count is not None and (not fits or fastest >= previous):
            break  # larger forward microbatches need more memory still, or stopped paying
        previous = min(previous, fastest)
    if base.parallel == "pp" and handoff is None:  # through the host: a lower peak for more copies
        candidate = dataclasses.replace(base, handoff="host")
        if progress:
            progress(f"simulating the {chosen} packing handing on through the host")
        results[f"{chosen}, handing on through the host"] = (_simulate(profile, candidate, batch_size, spec, host),
                                                              candidate)
    fits_host = lambda cuts: host.memory is None or host_bytes(profile, cuts, batch_size, host) <= host.memory  # noqa: E731
    compared = {policy: (sim.seconds if max(sim.peak_bytes) <= budget and fits_host(s.boundaries) else float("inf"))
                for policy, (sim, s) in results.items()}
    policy = min(compared, key=compared.get)
    simulation, schedule = results[policy]
    needed = host_bytes(profile, schedule.boundaries, batch_size, host)
    if compared[policy] == float("inf"):
        raise PlanningError(
            f"search: the stash of batch {batch_size} does not fit host memory: the best schedule needs "
            f"{format_size(needed)}, the host has {format_size(host.memory)}. Use a smaller batch.")
    recomputed = range(schedule.boundaries[-1])  # every pack but the last, which keeps its graph
    tiered = plan_host_memory(profile, schedule.boundaries, batch_size, host,
                              schedule.devices if schedule.parallel == "pp" else 1).nvme_bytes
    bound, what = lower_bound(profile, batch_size, devices, spec, host, recomputed, tiered)
    return PlanChoice(schedule, policy, simulation, batch_size, compared, bound, what, needed)


def _forward_counts(schedule: Schedule, apart: bool):
    """The forward's microbatch counts to try: the backward's (``None``), then, where the forward
    may run larger ones, 2, 4, 8, ... times fewer (whole backward microbatches each; with data
    parallelism, at least one per device)."""
    yield None
    ratio = 2
    while apart and schedule.microbatches % ratio == 0:
        count = schedule.microbatches // ratio
        if schedule.parallel == "dp" and count < schedule.devices:
            return
        yield count
        ratio *= 2


def _simulate(profile: ModelProfile, schedule: Schedule, batch_size: int, spec: DeviceSpec,
              host: HostSpec) -> Simulation:
    programs, costs = chain_schedule(profile, schedule, batch_size, spec, host)
    return simulate(programs, costs, spec, host, schedule.devices if schedule.parallel == "dp" else 1)
