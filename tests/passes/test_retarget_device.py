"""retarget_device / packs_on: a pack's factory ops make their tensors on the device that runs it.

A CPU machine has one torch device, so the other device here is ``meta``: the graphs' factory ops
must name it after retargeting, and the packs must still compute the same values."""
from __future__ import annotations

import torch
from torch import nn

import harmony_fx
from harmony_fx.passes.retarget_device import packs_on, retarget_device


class MaskedMLP(nn.Module):
    """Makes tensors inside the graph: a causal mask (``ones``/``tril``) and positions (``arange``)."""

    def __init__(self, width: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            mask = torch.ones(x.shape[-1], x.shape[-1], device=x.device).tril()
            positions = torch.arange(x.shape[-1], device=x.device, dtype=x.dtype)
            x = torch.relu(block(x) @ mask + positions)
        return x


def _factory_devices(gm) -> set[torch.device]:
    return {torch.device(node.kwargs["device"]) for node in gm.graph.nodes if node.kwargs.get("device") is not None}


def _compiled():
    torch.manual_seed(0)
    return harmony_fx.compile(MaskedMLP(), torch.randn(4, 8), microbatches=1, pack_boundaries=(0, 2))


def test_every_factory_op_of_every_pack_moves_to_the_device_that_runs_it():
    hm = _compiled()
    assert all(_factory_devices(pack.gm) == {torch.device("cpu")} for pack in hm.packs)
    moved = packs_on(hm.packs, torch.device("cpu"), torch.device("meta"))
    for before, after in zip(hm.packs, moved):
        assert after.gm is not before.gm and _factory_devices(after.gm) == {torch.device("meta")}
        assert _factory_devices(before.gm) == {torch.device("cpu")}  # the compiled packs are left as they were
        assert "device = device(type='meta')" in after.gm.code
    back = packs_on(moved, torch.device("meta"), torch.device("cpu"))
    assert all(_factory_devices(pack.gm) == {torch.device("cpu")} for pack in back)


def test_a_device_of_the_same_torch_device_shares_the_packs():
    hm = _compiled()
    assert packs_on(hm.packs, torch.device("cpu"), torch.device("cpu")) == list(hm.packs)
    assert all(a is b for a, b in zip(packs_on(hm.packs, torch.device("cpu"), torch.device("cpu")), hm.packs))


def test_only_the_source_device_is_rewritten():
    hm = _compiled()
    gm = packs_on(hm.packs, torch.device("cpu"), torch.device("meta"))[0].gm
    assert not retarget_device(gm, torch.device("cpu"), source=torch.device("cuda", 1))  # nothing on cuda:1
    assert _factory_devices(gm) == {torch.device("meta")}


def test_each_devices_runtime_runs_packs_made_for_it():
    hm = harmony_fx.compile(MaskedMLP(), torch.randn(4, 8), microbatches=2, devices=["host:0", "host:1"],
                            parallel="dp", pack_boundaries=(0, 2))
    iteration = hm.session.begin([[torch.randn(2, 8)], [torch.randn(2, 8)]])
    for runtime, device in zip(iteration.runtimes, hm.devices):
        for packs in runtime.packs_for_mb:
            assert all(_factory_devices(pack.gm) <= {device.torch_device} for pack in packs)
    iteration.release()
    hm.close()
