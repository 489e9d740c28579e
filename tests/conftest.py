"""Shared pytest setup. Markers ``cuda`` and ``slow`` are registered in pyproject.toml."""
from __future__ import annotations

import pytest
import torch

import harmony_fx.config

# The zoo's tensors are tiny: intra-op threads only add OpenMP synchronisation, which on a busy
# 2-core machine costs whole seconds per step. Harmony and its eager reference both run here, in
# this one process, so they see the same setting.
torch.set_num_threads(1)

# The tests compare measured peaks with the plans and an independent witness: HostDevices account
# every tensor here (outside the tests that is off by default, as it costs a dispatch per op).
harmony_fx.config.TRACK_MEMORY_BY_DEFAULT = True


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


@pytest.fixture
def memory_witness():
    """A ``DeviceMemoryWitness`` active for the whole test: what every HostDevice held, counted
    apart from the runtime's own accounting (tests/memory_witness.py)."""
    from tests.memory_witness import DeviceMemoryWitness

    with DeviceMemoryWitness() as witness:
        yield witness
