"""What a checkpoint holds, and the one-file form of it.

A checkpoint holds what decides the next losses: the host master weights and buffers (the model's
own tensors, which the compiled packs read every iteration), the optimizer's state, the step
counter and the RNG states. Only the global generators matter: a recompute replays an RNG state
saved by the forward of the same iteration, and each iteration starts with no saved states.

``TrainingState`` reads and writes that state wherever it lives (host memory, the NVMe tier, a
rank's chunks of a sharded optimizer); the one-file form is here, the folders any number of
processes read are ``checkpoint_folders``. With the NVMe tier it also makes the model's and the
optimizer's own ``state_dict()`` whole (``hook_tier``): a user's checkpoint code (``torch.save({"model":
model.state_dict(), "optimizer": optimizer.state_dict()})``, transformers' checkpoints) gets the
state the tier holds, read back, where it got host memory's alone (no moments for the tier's packs,
the bf16 copies for their masters); loading into them is refused, naming the trainer's own load.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import random
import tempfile
import weakref
from typing import Any, Callable, Iterator

import torch
from torch import nn

from harmony_fx.distributed.cluster import Cluster
from harmony_fx.distributed.updates import CrossProcessUpdates
from harmony_fx.runtime.host import grad_dtype
from harmony_fx.runtime.tier import StateTier

__all__ = ["TrainingState", "FORMAT", "check_same_model", "get_rng_states", "set_rng_states"]

# Stored in every checkpoint; a version per form, bumped when its layout changes.
FORMAT = "harmony_fx.Trainer"
FILE_VERSION = 1


@dataclasses.dataclass
class TrainingState:
    """The model and optimizer a Trainer trains, and where their state lives."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    tier: StateTier | None = None
    cross: CrossProcessUpdates | None = None
    cluster: Cluster | None = None
    _own_calls: int = 0  # > 0 while this class calls the model's and optimizer's state_dict itself

    @contextlib.contextmanager
    def own_calls(self) -> Iterator[None]:
        """This class's own calls of ``state_dict``/``load_state_dict``, which the hooks leave alone."""
        self._own_calls += 1
        try:
            yield
        finally:
            self._own_calls -= 1

    def hook_tier(self, settle: Callable[[], None]) -> list:
        """Make ``optimizer.state_dict()`` and ``model.state_dict()`` hold what the NVMe tier holds
        (read back from its committed files once ``settle`` has waited for the last step's), and refuse
        their ``load_state_dict``, which would fill host memory the tier's next reads ignore. Returns
        the hooks' handles (removed at the trainer's ``close``)."""
        ref = weakref.ref(self)  # the hooks must not keep the trainer's state alive

        def outside(state: "TrainingState | None") -> bool:
            return state is not None and state.tier is not None and state._own_calls == 0

        def optimizer_state(optimizer, state_dict):
            state = ref()
            if not outside(state):
                return None
            settle()
            params = [p for group in optimizer.param_groups for p in group["params"]]
            for index, param in enumerate(params):  # the indices torch's state_dict gives parameters
                stored = state.tier.stored(param)
                if stored:  # a new dict: the packed state's dicts are the optimizer's own
                    state_dict["state"][index] = {**state_dict["state"].get(index, {}), **stored}
            return state_dict

        def model_state(module, state_dict, prefix, local_metadata):
            state = ref()
            if outside(state) and state.tier.masters:
                settle()
                for name, param in module.named_parameters(remove_duplicate=False):  # a tied weight: each name
                    if id(param) in state.tier.masters and param.dtype == state.tier.compute_dtype:
                        state_dict[prefix + name] = state.tier.stored_master(param)

        def refuse_load(what: str):
            def refuse(*args):
                if outside(ref()):
                    raise ValueError(f"{what}.load_state_dict while a harmony_fx.Trainer keeps its state on the NVMe "
                                     "tier: the trainer's next steps read the tier, not what would be loaded. Load "
                                     "with trainer.load(path) or trainer.load_state_dict(...), which put the state on "
                                     "the tier, or call trainer.close() first.")
            return refuse

        return [self.optimizer.register_state_dict_post_hook(optimizer_state),
                self.optimizer.register_load_state_dict_pre_hook(refuse_load("optimizer")),
                self.model.register_state_dict_post_hook(model_state),
                self.model.register_load_state_dict_pre_hook(refuse_load("model"))]

    def model_state(self, copied: bool = True) -> dict[str, torch.Tensor]:
        """``model.state_dict()`` (``copied``: its tensors cloned), with the fp32 masters on the NVMe
        tier read back into it (host memory holds their bf16 copies)."""
        with self.own_calls():
            state = {name: t.detach().clone() if copied else t for name, t in self.model.state_dict().items()}
        if self.tier is not None and self.tier.masters:
            for name, param in self.model.named_parameters(remove_duplicate=False):  # a tied weight: each name
                if id(param) in self.tier.masters and name in state:
                    state[name] = self.tier.stored_master(param)
        return state

    def model_state_like(self) -> dict[str, torch.Tensor]:
        """The shapes and dtypes of ``model_state()``, on the meta device (nothing read)."""
        with self.own_calls():
            state = {name: torch.empty_like(t, device="meta") for name, t in self.model.state_dict().items()}
        masters = self.tier.masters if self.tier is not None else frozenset()
        for name, param in self.model.named_parameters(remove_duplicate=False):
            if name in state and id(param) in masters:  # its master's dtype: the gradient's
                state[name] = torch.empty_like(param, device="meta", dtype=grad_dtype(param))
        return state

    def optimizer_state_dict(self) -> dict[str, Any]:
        """``optimizer.state_dict()``, copied, with the state on the NVMe tier read back into it."""
        with self.own_calls():
            state_dict = copy.deepcopy(self.optimizer.state_dict())
        if self.tier is not None:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            for index, param in enumerate(params):  # the indices torch's state_dict gives parameters
                stored = self.tier.stored(param)
                if stored:
                    state_dict["state"].setdefault(index, {}).update(stored)  # fresh tensors, read now
        return state_dict

    def optimizer_state(self, param: nn.Parameter) -> dict[str, Any]:
        """The optimizer's whole state for ``param``: what host memory holds, and what is on the
        NVMe tier (read back)."""
        state = dict(self.optimizer.state.get(param, {}))
        if self.tier is not None and id(param) in self.tier.params:
            state.update(self.tier.stored(param))
        return state

    # ------------------------------------------------------------------ the one-file form
    def state_dict(self, step_count: int) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": FILE_VERSION,
            "step_count": step_count,
            "model": self.model_state(),
            # the optimizer's own state_dict shares its state tensors, which updates modify in place
            "optimizer": self.optimizer_state_dict(),
            "rng": get_rng_states(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> int:
        """Restore ``state_dict`` in place (the values copied into the existing master tensors,
        which the compiled packs hold); returns its step count. A checkpoint of another model is
        refused before anything changes."""
        if state_dict.get("format") != FORMAT or state_dict.get("version") != FILE_VERSION:
            raise ValueError(f"not a {FORMAT} checkpoint of version {FILE_VERSION} "
                             f"(format {state_dict.get('format')!r}, version {state_dict.get('version')!r})")
        check_same_model(self.model_state_like(), state_dict["model"])
        if self.tier is not None:
            # the fp32 masters the tier holds: what the model loads into, and the dtype the optimizer
            # casts its state to; store_all moves them back
            self.tier.masters_to_host()
        try:
            # the optimizer first: it checks its parameter groups before changing anything
            with self.own_calls():
                self.optimizer.load_state_dict(state_dict["optimizer"])
        except BaseException:
            if self.tier is not None:
                self.tier.masters_from_host()
            raise
        with self.own_calls():  # copy_ under no_grad: the tensors stay the same objects
            self.model.load_state_dict(state_dict["model"])
        set_rng_states(state_dict["rng"])
        step_count = state_dict["step_count"]
        if self.tier is not None:
            self.tier.store_all(step_count)  # the loaded state leaves host memory for the tier
        return step_count


def save_file(state_dict: dict[str, Any], path: str | os.PathLike) -> None:
    """``state_dict`` written atomically: a temporary file in the same directory (so the rename
    stays on one file system), renamed over ``path``; a crash mid-write leaves the previous
    checkpoint whole."""
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=f".{os.path.basename(path)}.",
                               suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state_dict, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the rename makes them the checkpoint
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's file is private; a checkpoint is an ordinary file
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def load_file(path: str | os.PathLike) -> dict[str, Any]:
    # everything in a checkpoint is tensors and plain Python values: no pickled code runs
    return torch.load(path, map_location="cpu", weights_only=True)


def check_same_model(expected: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> None:
    missing = sorted(expected.keys() - loaded.keys())
    unexpected = sorted(loaded.keys() - expected.keys())
    mismatched = [f"{name}: checkpoint {tuple(loaded[name].shape)} {loaded[name].dtype}, "
                  f"model {tuple(t.shape)} {t.dtype}"
                  for name, t in expected.items()
                  if name in loaded and (loaded[name].shape != t.shape or loaded[name].dtype != t.dtype)]
    problems = ([f"missing from the checkpoint: {', '.join(missing)}"] if missing else []) + \
               ([f"not in the model: {', '.join(unexpected)}"] if unexpected else []) + mismatched
    if problems:
        raise ValueError("the checkpoint is of a different model; " + "; ".join(problems))


def get_rng_states() -> dict[str, Any]:
    """Every global generator a model or data pipeline commonly draws from. Stored as tensors and
    plain Python values, so ``torch.load(weights_only=True)`` reads them back."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    # only when CUDA is in use: asking for its states would otherwise initialise it
    if torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    numpy = _numpy()
    if numpy is not None:
        _, key, pos, has_gauss, gauss = numpy.random.get_state()
        states["numpy"] = (key.tolist(), pos, has_gauss, gauss)  # a list, not an ndarray: weights_only
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))  # torch.load may hand back lists for tuples
    if "cuda" in states and torch.cuda.is_available():  # a GPU run resumed on a CPU has no CUDA RNG to set
        torch.cuda.set_rng_state_all(states["cuda"])
    numpy = _numpy()
    if numpy is not None and "numpy" in states:
        key, pos, has_gauss, gauss = states["numpy"]
        numpy.random.set_state(("MT19937", numpy.array(key, dtype=numpy.uint32), pos, has_gauss, gauss))


def _numpy():
    try:
        import numpy
    except ImportError:  # optional: without numpy there is no numpy RNG to keep
        return None
    return numpy


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
