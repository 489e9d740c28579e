"""Shared pytest setup. Markers ``cuda`` and ``slow`` are registered in pyproject.toml."""
from __future__ import annotations

import gc

import pytest
import torch

import harmony_fx.config
from tests import helpers, tiers

# The zoo's tensors are tiny: intra-op threads only add OpenMP synchronisation, which on a busy
# 2-core machine costs whole seconds per step. Harmony and its eager reference both run here, in
# this one process, so they see the same setting.
torch.set_num_threads(1)

# The tests compare measured peaks with the plans and an independent witness: HostDevices account
# every tensor here (outside the tests that is off by default, as it costs a dispatch per op).
harmony_fx.config.TRACK_MEMORY_BY_DEFAULT = True


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by the marks given here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test's suite as ``tests/tiers.py`` says; an entry there that names no test of a file
    collected whole is an error (a renamed test would silently come back to the default suite)."""
    for item in items:
        tier = tiers.tier_of(item.nodeid)
        if tier is not None:
            item.add_marker(tier)
    if not config.option.keyword and all("::" not in arg for arg in config.args):
        stale = tiers.unmatched([item.nodeid for item in items])
        if stale:
            raise pytest.UsageError("tests/tiers.py names tests that do not exist: " + ", ".join(stale))


@pytest.fixture(autouse=True)
def _devices_by_marker(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests marked ``cuda`` run only where a CUDA GPU exists; every other test runs on HostDevices
    even there (``devices=None`` would take the GPU, whose allocator and workspaces the exact peak
    assertions are not about)."""
    if request.node.get_closest_marker("cuda") is not None:
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    else:
        monkeypatch.setattr("harmony_fx.runtime.devices.visible_gpus", lambda: 0)


def _global_state() -> dict[str, object]:
    """What harmony_fx must never leave changed (it restores each in ``finally``)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from harmony_fx.runtime.ambient import Autocast

    return {
        "grad mode": torch.is_grad_enabled(),
        "inference mode": torch.is_inference_mode_enabled(),
        "autocast": Autocast.current(),
        "autocast cache": torch.is_autocast_cache_enabled(),
        "default dtype": torch.get_default_dtype(),
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "threads": torch.get_num_threads(),
        "dispatch modes": len(_get_current_dispatch_mode_stack()),
        "torch function modes": torch._C._len_torch_function_stack(),
        "garbage collector": (gc.isenabled(), gc.get_freeze_count() > 0, gc.get_threshold()),
        "autograd.Function.apply": torch.autograd.Function.__dict__["apply"],  # capture records Functions
        "Tensor.register_hook": torch.Tensor.__dict__["register_hook"],  # capture notes hooks in forward
    }


@pytest.fixture(autouse=True)
def _no_global_state_leaks():
    """Fails a test after which grad mode, autocast, the default dtype, ... differ from before it:
    one leak (a grad mode left off) otherwise fails every later test in the worker far from its
    cause. The state is put back so that the next test starts clean."""
    before = _global_state()
    yield
    after = _global_state()
    changed = {name: (before[name], after[name]) for name in before if before[name] != after[name]}
    if changed:
        torch.set_grad_enabled(before["grad mode"])
        torch.set_default_dtype(before["default dtype"])
        torch.set_num_threads(before["threads"])
        torch.use_deterministic_algorithms(before["deterministic algorithms"])
        torch.autograd.Function.apply = before["autograd.Function.apply"]
        torch.Tensor.register_hook = before["Tensor.register_hook"]
        pytest.fail(f"the test left global state changed (before, after): {changed}", pytrace=False)


@pytest.fixture
def memory_witness():
    """A ``DeviceMemoryWitness`` active for the whole test: what every HostDevice held, counted
    apart from the runtime's own accounting (tests/memory_witness.py)."""
    from tests.memory_witness import DeviceMemoryWitness

    with DeviceMemoryWitness() as witness:
        yield witness


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """This machine's calibration faked (``helpers.fake_machine``): a cache of the test's own and
    measurements that return what the test says."""
    yield from helpers.fake_machine(tmp_path, monkeypatch)
