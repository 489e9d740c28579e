"""Options of ``harmony_fx.compile`` and ``harmony_fx.Trainer`` as one frozen dataclass, and the
parsing of sizes such as ``"2GiB"``."""
from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import os
import re
from typing import Any, Callable, Iterable, Literal, Mapping

import numpy
import torch

__all__ = ["CompileOptions", "parse_size", "format_size", "cuda_reserve", "option_names", "check_option_names",
           "options_from_environment", "with_environment", "ENVIRONMENT_VARIABLES"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}


def parse_size(size: int | float | str | None) -> int | None:
    """Bytes from ``1024``, ``"512MiB"``, ``"2GiB"``, ``"1.5 GB"``; ``None`` stays ``None``."""
    if size is None:
        return None
    if isinstance(size, bool):
        raise TypeError(f"a size must be a number of bytes or a string like '2GiB', not {size!r}")
    if isinstance(size, (int, float)):
        if not math.isfinite(size):
            raise ValueError(f"a size must be a finite number of bytes, got {size!r}")
        if size <= 0:
            raise ValueError(f"a size must be positive, got {size!r}")
        if size != int(size):
            raise ValueError(f"a size in bytes must be a whole number, got {size!r}: write bytes, or a string "
                             "with a unit such as '1.5GiB'")
        return int(size)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(size))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot read the size {size!r}: write a number of bytes or a number with a unit, "
            "e.g. 1048576, '1e6', '512MiB', '2GiB', '1.5GB' (KB, MB, GB, TB: powers of 1000; "
            "KiB, MiB, GiB, TiB and K, M, G, T: of 1024)"
        )
    value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if value <= 0:
        raise ValueError(f"a size must be at least one byte, got {size!r}")
    return value


def format_size(num_bytes: int | float) -> str:
    """``1536 -> '1.5 KiB'``: sizes a person reads."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


# ``CompileOptions(track_memory=None)``: whether a HostDevice accounts every tensor (tests: True)
TRACK_MEMORY_BY_DEFAULT = False


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    """Everything ``compile`` and ``Trainer`` accept besides the model and its inputs.

    ``devices``: ``None`` (every CUDA GPU, else one HostDevice), an int N, or names such as
    ``["cuda:0", "cuda:1"]`` / ``["host:0"]``.
    ``memory_budget``: bytes per device (``None``: the device's own capacity).
    ``microbatches``: how many microbatches a batch is cut into (``None``: the planner chooses); or
    ``{"forward": Mf, "backward": Mb}``: the forward runs Mf larger microbatches (it holds nothing
    for the backward but each pack's inputs), the backward Mb smaller ones, Mb a multiple of Mf
    (the Trainer; models without random ops).
    ``parallel``: ``"auto" | "dp" | "pp"``.
    ``verify``: run the program verifier before the first run (cheap; on by default).
    ``track_memory``: account every tensor a task creates on a HostDevice (the measured peak, and
    a device that refuses to pass its budget); ``None``: ``TRACK_MEMORY_BY_DEFAULT`` (off: the plan's
    check keeps the budget, and tracking costs a dispatch per op; the test suite turns it on).
    Compiled packs run without it.
    ``grouping``: a pack's weights come in once for all microbatches (``False``: once per
    microbatch, the baseline that input-batch grouping is measured against).
    ``batch_dims``: the batch dim of every input (an int), or ``{argument name: dim or None}``.
    ``precision``: ``"bf16"`` computes and moves floating tensors in bfloat16 on the device; master
    weights, optimizer state and gradients on the host stay fp32.
    ``frozen_to_bf16``: with ``precision="bf16"``, every frozen fp32 parameter
    (``requires_grad=False``: a LoRA model's base) is converted in place to bfloat16 before the model
    is captured (its ``.data``; the ``nn.Parameter`` object stays), so the host holds 2 bytes an
    element instead of the fp32 tensor plus its bf16 copy (6), and computes with the same values. The
    fp32 values are dropped: the model keeps its frozen weights in bf16 after training, and so does
    its ``state_dict`` (``frontend.frozen``). A parameter unfrozen later stays bf16 unless cast back.
    On a GPU the devices still stage a pinned copy of each pageable bf16 weight (4 bytes there).
    ``pack_boundaries``: fix the packs (the index of each pack's first layer) instead of planning.
    ``forward_groups``: with ``pack_boundaries``, larger packs for the forward (which holds no graph
    and no gradients): the first pack of each group. In a pipeline each group is one forward task of the wrap.
    ``handoff``: how a pipeline hands a microbatch's values to the next device: ``"peer"`` device
    to device (the sender keeps them until its pack ends), ``"host"`` through the stash on the host
    (each microbatch's freed as soon as its copy landed: a lower peak, more host traffic);
    ``None``: the planner's choice, else ``"peer"``.
    ``chaos``: a seed: HostDevice streams run on worker threads with random delays, so a missing
    wait shows up as a wrong number or an error (a testing aid; slower).
    ``compile_packs``: every pack's forward and backward compiled by inductor (``runtime.inductor``);
    ``None``: on when every device is a GPU.
    ``timeline``: record every op's span and the memory after it (``save_trace``, ``plot_memory``);
    off, a task costs no bookkeeping (``HarmonyModule.record_timeline`` turns it on later).
    ``nvme_path`` (``Trainer``): a directory on fast local storage for the optimizer state that host
    memory should not hold: one checksummed file per pack, streamed in and out through its update a
    parameter at a time by a reader and a writer thread (``READ``/``WRITE`` in the program).
    Without ``host_memory``, every pack's state goes there.
    ``host_memory`` (``Trainer``): host memory a step may hold (``"64GiB"``); with ``nvme_path`` the
    plan moves the fewest packs' state to the tier that fit it, without, a step that would not fit
    is refused before it runs.
    ``resident_weights``: the model's weights stay on the one device that computes, for a model that
    fits there: no weight comes in or goes out, gradients are left on the device in ``param.grad``,
    and the optimizer is the caller's, where they put it (a fused AdamW on the GPU); the packs,
    recomputation and microbatches are as ever. ``None``: as the model is placed (on the CPU: the
    weights live in host memory; on the one GPU named in ``devices``: resident); ``True`` on a
    HostDevice: the model, on the CPU, counts as already on that stand-in device.
    ``harmony_fx.compile`` only: the ``Trainer`` steps its optimizer on the host.
    """

    devices: object = None
    memory_budget: int | str | None = None
    microbatches: int | Mapping[str, int] | None = None
    parallel: Literal["auto", "dp", "pp"] = "auto"
    verify: bool = True
    track_memory: bool | None = None
    grouping: bool = True
    batch_dims: object = 0
    precision: Literal["fp32", "bf16"] = "fp32"
    frozen_to_bf16: bool = False
    pack_boundaries: tuple[int, ...] | None = None
    forward_groups: tuple[int, ...] | None = None
    handoff: Literal["peer", "host"] | None = None
    chaos: int | None = None
    compile_packs: bool | None = None
    timeline: bool = False
    nvme_path: object = None
    host_memory: int | str | None = None
    resident_weights: bool | None = None
    # set from ``microbatches={"forward": Mf, ...}``: the forward's count (``None``: the backward's)
    forward_microbatches: int | None = None

    @property
    def compute_dtype(self) -> torch.dtype | None:
        return torch.bfloat16 if self.precision == "bf16" else None

    def __post_init__(self) -> None:
        self._check_flags_and_counts()
        object.__setattr__(self, "memory_budget", parse_size(self.memory_budget))
        object.__setattr__(self, "host_memory", parse_size(self.host_memory))
        if self.nvme_path is not None and not isinstance(self.nvme_path, (str, os.PathLike)):
            raise TypeError(f"nvme_path must be a directory path, got {type(self.nvme_path).__name__}")
        if self.track_memory and self.compile_packs:
            raise ValueError("compile_packs=True runs packs compiled by inductor, which cannot run under the "
                             "HostDevice's per-tensor accounting: pass track_memory=False (the plan's check still "
                             "keeps the budget) or compile_packs=False")
        if isinstance(self.microbatches, Mapping):
            self._split_microbatches(dict(self.microbatches))
        if self.microbatches is not None and (
            not isinstance(self.microbatches, int) or isinstance(self.microbatches, bool) or self.microbatches < 1
        ):
            raise ValueError(f"microbatches must be a positive int, {{'forward': Mf, 'backward': Mb}} or None, "
                             f"got {self.microbatches!r}")
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"precision must be 'fp32' or 'bf16', got {self.precision!r}")
        if self.frozen_to_bf16 and self.precision != "bf16":
            raise ValueError("frozen_to_bf16=True keeps frozen weights in the bf16 that precision='bf16' computes "
                             f"with, but precision={self.precision!r}: pass precision='bf16' too, or convert the "
                             "frozen weights yourself (model.to(torch.bfloat16) before adding fp32 adapters)")
        if self.forward_groups is not None and self.pack_boundaries is None:
            raise ValueError("forward_groups groups the packs of pack_boundaries: give both, or neither")
        if self.handoff not in (None, "peer", "host"):
            raise ValueError(f"handoff must be 'peer', 'host' or None, got {self.handoff!r}")
        if self.parallel not in ("auto", "dp", "pp"):
            raise ValueError(f"parallel must be 'auto', 'dp' or 'pp', got {self.parallel!r}")

    def _check_flags_and_counts(self) -> None:
        """A flag must be a bool (``grouping="no"`` is a true string: grouping on, silently) and a
        seed or a count an int; ``None`` where the option allows it. NumPy's are taken (a sweep's
        table hands them over), as Python's."""
        for name in ("verify", "grouping", "frozen_to_bf16", "timeline", "track_memory", "compile_packs",
                     "resident_weights"):
            value = getattr(self, name)
            optional = name in ("track_memory", "compile_packs", "resident_weights")
            if isinstance(value, numpy.bool_):
                object.__setattr__(self, name, bool(value))
            elif not isinstance(value, bool) and not (optional and value is None):
                raise TypeError(f"{name} must be True or False{' (or None)' if optional else ''}, got {value!r}")
        for name in ("chaos", "microbatches"):
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, (bool, numpy.bool_)):
                object.__setattr__(self, name, int(value))
        if self.chaos is not None and (not isinstance(self.chaos, int) or isinstance(self.chaos, bool)):
            raise TypeError(f"chaos must be an int seed (or None), got {self.chaos!r}")

    def _split_microbatches(self, given: dict) -> None:
        forward, backward = given.pop("forward", None), given.pop("backward", None)
        counts_ok = all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in (forward, backward))
        if given or not counts_ok:
            raise ValueError(f"microbatches as a dict is {{'forward': Mf, 'backward': Mb}} with two positive ints, "
                             f"got {self.microbatches!r}")
        if backward % forward:
            raise ValueError(f"microbatches={self.microbatches!r}: the backward's count ({backward}) must be a multiple "
                             f"of the forward's ({forward}), so that each forward microbatch is whole backward ones; "
                             f"try {{'forward': {forward}, 'backward': {forward * max(1, round(backward / forward))}}}")
        object.__setattr__(self, "microbatches", backward)
        object.__setattr__(self, "forward_microbatches", forward if forward < backward else None)

    @property
    def tracks_memory(self) -> bool:
        """``track_memory`` resolved (see the class docstring)."""
        if self.track_memory is not None:
            return self.track_memory
        return TRACK_MEMORY_BY_DEFAULT and not self.compile_packs


# Fields that harmony_fx sets itself, never a user: ``forward_microbatches`` comes from
# ``microbatches={"forward": Mf, "backward": Mb}``, and passing it too would bypass that check.
_INTERNAL_OPTIONS = frozenset({"forward_microbatches"})


def _is_internal(name: str) -> bool:
    return name in _INTERNAL_OPTIONS or name.startswith("_")


def option_names() -> tuple[str, ...]:
    """The ``CompileOptions`` fields a user may pass (to ``compile``, the ``Trainer``, the backend)."""
    return tuple(field.name for field in dataclasses.fields(CompileOptions) if not _is_internal(field.name))


# ``harmony_fx.Trainer``'s own options (it steps the optimizer): at a door that does not, where they go
TRAINER_OPTIONS = ("max_grad_norm", "loss_reduction", "skip_nonfinite", "atomic", "process_group", "shard_optimizer",
                   "collective_timeout")
# options that size the optimizer's host state (compile options a Trainer reads): a door's forward-only
# compile, or one beside a Trainer (the backend, reading the environment), leaves them out
HOST_STATE_OPTIONS = ("nvme_path", "host_memory")
_PROCESS_OPTIONS = ("process_group", "shard_optimizer", "collective_timeout")
_WHERE_PROCESS_OPTIONS_GO = ("an option of harmony_fx.Trainer, which trains across processes: run it under torchrun "
                             "(examples/torchrun_train.py)")
_WHERE_TRAINER_OPTIONS_GO = ("an option of harmony_fx.Trainer, which steps the optimizer: where your loop steps it, "
                             "do it there (torch.nn.utils.clip_grad_norm_ for max_grad_norm)")


def check_option_names(given: Iterable[str], valid: Iterable[str], door: str,
                       elsewhere: Mapping[str, str] | None = None) -> None:
    """Refuse the names in ``given`` that are not in ``valid`` (internal fields never are) with a
    ``TypeError`` that names ``door`` (where the options were passed), suggests the nearest valid
    name of each, and lists the valid ones: a typo would otherwise get Python's bare "unexpected
    keyword argument", from a dataclass the user never called. ``elsewhere``: a right name at
    the wrong door, and where it goes (by default, the Trainer's own options)."""
    valid = sorted({name for name in valid if not _is_internal(name)})
    unknown = [name for name in given if name not in valid]
    if not unknown:
        return
    elsewhere = {**{name: _WHERE_TRAINER_OPTIONS_GO for name in TRAINER_OPTIONS},
                 **{name: _WHERE_PROCESS_OPTIONS_GO for name in _PROCESS_OPTIONS}, **(elsewhere or {})}
    misplaced = [name for name in unknown if name in elsewhere]
    if misplaced:
        raise TypeError(f"{door} does not take {misplaced[0]!r}: it is {elsewhere[misplaced[0]]}.")
    described = []
    for name in unknown:
        nearest = difflib.get_close_matches(str(name), valid, n=1)
        described.append(f"{name!r} (did you mean {nearest[0]!r}?)" if nearest else repr(name))
    plural = "s" if len(unknown) > 1 else ""
    raise TypeError(f"{door} got the unknown option{plural} {', '.join(described)}. Correct the name{plural}; "
                    f"the valid options are: {', '.join(valid)}.")


def _devices_from_text(text: str) -> int | list[str]:
    """``"2"`` -> 2 (that many devices); ``"cuda:0,cuda:1"`` -> the names."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ValueError("name the devices, e.g. '2', 'cuda:0,cuda:1' or 'host:0'")
    return names


def _count_from_text(text: str) -> int:
    if not text.strip().isdigit():
        raise ValueError("write a whole number, e.g. 4")
    return int(text)


# Environment variables that set harmony's options where a script cannot be edited (its own
# options win over them): ``HARMONY_FX_MEMORY_BUDGET=8GiB python train.py``. Read by the doors
# that take options from a framework (the torch.compile backend, the Hugging Face and Lightning
# integrations), not by ``harmony_fx.compile``/``harmony_fx.Trainer``, whose arguments are the code.
ENVIRONMENT_VARIABLES: dict[str, tuple[str, Callable[[str], Any]]] = {
    "HARMONY_FX_MEMORY_BUDGET": ("memory_budget", str.strip),   # "8GiB": parsed by CompileOptions
    "HARMONY_FX_DEVICES": ("devices", _devices_from_text),
    "HARMONY_FX_MICROBATCHES": ("microbatches", _count_from_text),
    "HARMONY_FX_PRECISION": ("precision", str.strip),
    "HARMONY_FX_PARALLEL": ("parallel", str.strip),
    "HARMONY_FX_HOST_MEMORY": ("host_memory", str.strip),
    "HARMONY_FX_NVME_PATH": ("nvme_path", str.strip),
}
# HARMONY_FX_ variables with another use than an option (not refused as misspelled ones)
_OTHER_VARIABLES = frozenset({"HARMONY_FX_CACHE"})


def options_from_environment(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Harmony's options that ``HARMONY_FX_*`` environment variables set (``ENVIRONMENT_VARIABLES``),
    each value parsed and checked here, so a wrong one is named by its variable. An unknown
    ``HARMONY_FX_*`` variable is refused with the nearest known name: a misspelled budget would
    otherwise be ignored, and the run would go on without it."""
    environ = os.environ if environ is None else environ
    options: dict[str, Any] = {}
    for variable, text in environ.items():
        if not variable.startswith("HARMONY_FX_") or variable in _OTHER_VARIABLES:
            continue
        if variable not in ENVIRONMENT_VARIABLES:
            nearest = difflib.get_close_matches(variable, list(ENVIRONMENT_VARIABLES), n=1)
            hint = f" (did you mean {nearest[0]}?)" if nearest else ""
            raise ValueError(f"the environment variable {variable} is not one of harmony_fx's{hint}; the known ones are "
                             f"{', '.join(ENVIRONMENT_VARIABLES)}. Correct or unset it.")
        name, parse = ENVIRONMENT_VARIABLES[variable]
        try:
            options[name] = parse(text)
            CompileOptions(**{name: options[name]})  # the option's own checks, blamed on the variable
        except (TypeError, ValueError) as error:
            raise ValueError(f"the environment variable {variable}={text!r} (harmony_fx's {name} option) cannot be "
                             f"used: {error}") from error
    return options


def with_environment(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """``options`` over those the environment sets: what the code says wins."""
    return {**options_from_environment(), **(options or {})}


# What a GPU needs beyond the tensors a plan counts: cuBLAS and cuDNN workspaces (about 32 MiB per
# handle and stream on Hopper), the caching allocator's rounding (512-byte blocks, unsplit remainders
# up to 1 MiB) and fragmentation. The CUDA context itself is outside the allocator, and already
# missing from what ``torch.cuda.mem_get_info`` reports free.
CUDA_RESERVE_FIXED = 256 * 2**20
CUDA_RESERVE_FRACTION = 0.05


CUDA_RESERVE_CAP = 0.10  # a small budget (a test's) keeps a tenth: its programs are small too


def cuda_reserve(budget: int) -> int:
    """Bytes a plan keeps free below a GPU ``budget`` (``CudaDevice.margin``, and the planner's GPU specs)."""
    return min(CUDA_RESERVE_FIXED + int(budget * CUDA_RESERVE_FRACTION), int(budget * CUDA_RESERVE_CAP))
