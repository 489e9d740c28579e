"""plan_host_memory: what a step holds in host memory, and which packs' optimizer state goes to the
NVMe tier so that it fits.

On hand-made parameter groups with known byte counts: with a tier and no limit every pack with
state goes there; under a limit, the fewest packs, largest state first, whose host memory (counted
here from the parameters, independently of the pass) fits, where one pack fewer would not; a limit
nothing fits names the smallest that does, and without a tier suggests ``nvme_path``; without undo
copies (``keeps_copies=False``) that term is gone. Under bf16 compute the host also holds each
stager's bf16 copy of every weight, and once all the state is on the tier the fp32 masters follow,
largest first, each leaving its bf16 copy as the only host tensor.
"""
from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from harmony_fx.compiler.host_memory import OptimizerFacts, plan_host_memory
from harmony_fx.config import format_size

FLOAT = 4  # bytes per float32 element
STATE_PER_ELEMENT = 8  # two float32 moments, as AdamW
STASH = 100
# parameters whose state the tier holds in host memory at once on one device: two read ahead for the
# pack opened next and for the pack being updated, the one being stepped, the one being written
STAGED_PARAMS = 6
# parameters' element counts per pack (many small parameters: streaming them costs little);
# pack 4 updates nothing (no state: never tiered)
NUMELS = {0: [10] * 12, 1: [10] * 30, 2: [10] * 20, 3: [10] * 25, 4: [], 5: [5] * 8}
BY_STATE = [1, 3, 2, 0, 5]  # the packs with state, largest state first
SIZE = re.compile(r"\d+(\.\d+)? (B|KiB|MiB|GiB|TiB)")


def _groups() -> dict[int, list[nn.Parameter]]:
    return {pack: [nn.Parameter(torch.zeros(n)) for n in numels] for pack, numels in NUMELS.items()}


def _buffer() -> torch.Tensor:
    return torch.zeros(6)  # a master that is no parameter (a buffer): counted in masters only


def _facts(keeps_copies: bool = True) -> OptimizerFacts:
    return OptimizerFacts(state_bytes=lambda p: STATE_PER_ELEMENT * p.numel(), keeps_copies=keeps_copies)


def _plan(host_memory: int | None, tier: bool = True, keeps_copies: bool = True):
    groups = _groups()
    masters = [p for params in groups.values() for p in params] + [_buffer()]
    return plan_host_memory(groups, masters, STASH, _facts(keeps_copies), host_memory, tier)


def _state(pack: int) -> int:
    return sum(STATE_PER_ELEMENT * n for n in NUMELS[pack])


def _expected(tiered, keeps_copies: bool = True) -> dict[str, int]:
    """Host memory of a step with ``tiered``'s state on the tier, from the element counts alone."""
    params = sum(FLOAT * n for numels in NUMELS.values() for n in numels)
    kept = sum(_state(pack) for pack in NUMELS if pack not in tiered)
    staged = STAGED_PARAMS * max((STATE_PER_ELEMENT * n for pack in tiered for n in NUMELS[pack]), default=0)
    needs = {"masters": params + FLOAT * 6, "grads": params, "state": kept, "stash": STASH,
             "copies": params + kept if keeps_copies else 0, "staging": staged, "weight_copies": 0}
    needs["total"] = sum(needs.values())
    return needs


def _needs(plan) -> dict[str, int]:
    needs = plan.needs
    return {"masters": needs.masters, "grads": needs.grads, "state": needs.state, "stash": needs.stash,
            "copies": needs.copies, "staging": needs.staging, "weight_copies": needs.weight_copies,
            "total": needs.total}


def test_the_example_is_what_this_file_assumes():
    assert sorted(BY_STATE, key=_state, reverse=True) == BY_STATE and len(set(map(_state, BY_STATE))) == len(BY_STATE)
    # every pack more on the tier lowers the total: the limits below have one answer each
    totals = [_expected(BY_STATE[:k])["total"] for k in range(len(BY_STATE) + 1)]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == len(totals)


def test_a_tier_without_a_limit_takes_every_pack_with_state():
    plan = _plan(None)
    assert plan.tier_packs == tuple(sorted(BY_STATE))  # not pack 4, which has no state
    assert plan.pack_state_bytes == {pack: _state(pack) for pack in NUMELS}
    assert plan.tier_bytes == sum(_state(pack) for pack in NUMELS) > 0
    assert _needs(plan) == _expected(BY_STATE)
    assert plan.needs.state == 0 and plan.host_memory is None


def test_no_tier_and_no_limit_keeps_everything_in_host_memory():
    plan = _plan(None, tier=False)
    assert plan.tier_packs == () and plan.tier_bytes == 0
    assert _needs(plan) == _expected(())


def test_a_limit_between_the_extremes_tiers_the_fewest_largest_packs_that_fit():
    # three packs fit it; two do not
    host_memory = (_expected(BY_STATE[:2])["total"] + _expected(BY_STATE[:3])["total"]) // 2
    assert _expected(BY_STATE)["total"] < host_memory < _expected(())["total"]
    plan = _plan(host_memory)
    assert plan.tier_packs == tuple(sorted(BY_STATE[:3])) == (1, 2, 3)
    assert _needs(plan) == _expected(BY_STATE[:3])
    assert plan.needs.total <= host_memory < _expected(BY_STATE[:2])["total"]
    assert plan.tier_bytes == sum(_state(pack) for pack in BY_STATE[:3])
    assert plan.host_memory == host_memory


@pytest.mark.parametrize("k", range(len(BY_STATE) + 1))
def test_each_limit_takes_exactly_the_packs_it_needs(k):
    """A limit equal to the total with the k largest packs tiered takes those k; one byte less, one more."""
    exact = _expected(BY_STATE[:k])["total"]
    plan = _plan(exact)
    assert plan.tier_packs == tuple(sorted(BY_STATE[:k]))
    assert plan.needs.total == exact
    if k < len(BY_STATE):
        tighter = _plan(exact - 1)
        assert tighter.tier_packs == tuple(sorted(BY_STATE[:k + 1]))
        assert tighter.needs.total == _expected(BY_STATE[:k + 1])["total"] <= exact - 1


def test_a_limit_below_everything_on_the_tier_names_the_smallest_that_fits():
    smallest = _expected(BY_STATE)["total"]
    _plan(smallest)  # fits, with every pack on the tier
    with pytest.raises(ValueError) as info:
        _plan(smallest - 1)
    message = str(info.value)
    assert message.startswith("plan_host_memory:")
    assert "host_memory" in message and SIZE.search(message)
    assert f"at least {format_size(smallest)}" in message
    assert "nvme_path" not in message  # there is a tier already


def test_without_a_tier_a_limit_too_small_suggests_nvme_path():
    everything = _expected(())["total"]
    assert _plan(everything, tier=False).tier_packs == ()  # fits in host memory: nothing moves
    with pytest.raises(ValueError) as info:
        _plan(everything - 1, tier=False)
    message = str(info.value)
    assert "host_memory" in message and f"at least {format_size(everything)}" in message
    assert "nvme_path" in message


def test_without_undo_copies_the_copies_term_is_gone():
    with_copies, without = _plan(None), _plan(None, keeps_copies=False)
    assert without.needs.copies == 0 < with_copies.needs.copies
    assert _needs(without) == _expected(BY_STATE, keeps_copies=False)
    # with nothing tiered, the copies were of every parameter and every pack's state
    kept = _plan(None, tier=False, keeps_copies=True).needs
    assert kept.copies == kept.grads + kept.state
    assert _plan(None, tier=False, keeps_copies=False).needs.total == kept.total - kept.copies


BF16 = 2  # bytes per bfloat16 element
ELEMENTS = sum(n for numels in NUMELS.values() for n in numels) + 6  # every floating master, the buffer too


def _plan_bf16(host_memory: int | None, stagers: int = 1):
    groups = _groups()
    masters = [p for params in groups.values() for p in params] + [_buffer()]
    return plan_host_memory(groups, masters, STASH, _facts(), host_memory, True, compute_dtype=torch.bfloat16,
                     weight_stagers=stagers)


def _expected_bf16(masters_tiered, stagers: int = 1) -> dict[str, int]:
    """Every pack's state on the tier and the fp32 masters of ``masters_tiered`` too, under bf16."""
    needs = _expected(BY_STATE)
    moved = sum(n for pack in masters_tiered for n in NUMELS[pack])
    needs["masters"] -= (FLOAT - BF16) * moved  # each moved master leaves its bf16 copy
    needs["copies"] -= FLOAT * moved            # its committed file is its undo copy
    needs["weight_copies"] = stagers * BF16 * (ELEMENTS - moved)
    needs["staging"] = STAGED_PARAMS * max(STATE_PER_ELEMENT * n + (FLOAT * n if pack in masters_tiered else 0)
                                           for pack in BY_STATE for n in NUMELS[pack])
    needs["total"] = sum(v for k, v in needs.items() if k != "total")
    return needs


@pytest.mark.parametrize("stagers", [1, 2])
def test_under_bf16_without_a_limit_only_the_state_moves_and_each_stager_copies_the_weights(stagers):
    plan = _plan_bf16(None, stagers)
    assert plan.tier_packs == tuple(sorted(BY_STATE)) and plan.tier_master_packs == ()
    assert _needs(plan) == _expected_bf16((), stagers)
    assert plan.tier_bytes == sum(_state(pack) for pack in NUMELS)


@pytest.mark.parametrize("k", range(len(BY_STATE) + 1))
def test_under_bf16_the_masters_follow_once_all_state_is_on_the_tier_largest_first(k):
    exact = _expected_bf16(BY_STATE[:k])["total"]
    plan = _plan_bf16(exact)
    assert plan.tier_packs == tuple(sorted(BY_STATE))
    assert plan.tier_master_packs == tuple(sorted(BY_STATE[:k]))
    assert _needs(plan) == _expected_bf16(BY_STATE[:k])
    assert plan.tier_bytes == sum(_state(p) for p in NUMELS) + sum(FLOAT * n for p in BY_STATE[:k] for n in NUMELS[p])
    if k < len(BY_STATE):
        assert _plan_bf16(exact - 1).tier_master_packs == tuple(sorted(BY_STATE[:k + 1]))


def test_under_bf16_a_limit_below_every_master_on_the_tier_names_the_smallest_that_fits():
    smallest = _expected_bf16(BY_STATE)["total"]
    with pytest.raises(ValueError, match=f"at least {re.escape(format_size(smallest))}"):
        _plan_bf16(smallest - 1)
