"""decide_layout: how many microbatches an iteration has, their sizes and which device runs each.

Checked against the batch cut here with ``torch.tensor_split`` (the sizes, the larger forward
microbatches' sizes as sums of the samples they join) and the microbatch indices shared out the
same way over the devices; the planner's schedule, where there is one, decides over the options;
a compiled module runs the layout decided for it.
"""
from __future__ import annotations

import pytest
import torch

import harmony_fx
from harmony_fx.compiler.layout import decide_layout
from harmony_fx.config import CompileOptions
from harmony_fx.models import MLPChain
from harmony_fx.planner.chain import Schedule


def _cut(total: int, parts: int) -> tuple[tuple[int, ...], ...]:
    """``range(total)`` cut into ``parts`` contiguous pieces, as even as they can be (tensor_split's cut)."""
    return tuple(tuple(piece.tolist()) for piece in torch.tensor_split(torch.arange(total), parts))


def _sizes(batch: int, parts: int) -> tuple[int, ...]:
    return tuple(len(piece) for piece in _cut(batch, parts))


def _unasked() -> int:
    raise AssertionError("the batch size was asked for, though the batch is not cut")


@pytest.mark.parametrize("batch,num", [(10, 3), (32, 4), (7, 7), (9, 2)])
def test_one_device_runs_every_microbatch_of_the_batch_as_cut_here(batch, num):
    layout = decide_layout(None, CompileOptions(microbatches=num), 1, lambda: batch)
    assert layout.parallel == "single" and layout.num_microbatches == num
    assert layout.mb_sizes == _sizes(batch, num) and sum(layout.mb_sizes) == batch
    assert layout.sizes == layout.mb_sizes  # no larger forward microbatches
    assert layout.device_microbatches == (tuple(range(num)),)
    assert layout.update_arrivals == 1 and layout.forward_parts == () and layout.forward_groups is None


def test_one_microbatch_is_the_whole_batch_and_its_size_is_not_asked():
    layout = decide_layout(None, CompileOptions(), 1, _unasked)
    assert layout.num_microbatches == 1 and layout.mb_sizes == (None,)
    assert layout.device_microbatches == ((0,),)
    assert layout.describe() == "1 microbatch(es) (the whole batch), one device"


@pytest.mark.parametrize("num_devices,num", [(2, 4), (2, 5), (3, 7), (3, 3)])
def test_data_parallel_gives_each_microbatch_to_one_device(num_devices, num):
    layout = decide_layout(None, CompileOptions(microbatches=num, parallel="dp"), num_devices, lambda: 21)
    assert layout.parallel == "dp"
    assert layout.device_microbatches == _cut(num, num_devices)
    assert sorted(mb for share in layout.device_microbatches for mb in share) == list(range(num))
    # every device reports each pack's update: the host steps it once all have
    assert layout.update_arrivals == num_devices
    assert layout.mb_sizes == _sizes(21, num)


def test_a_pipeline_runs_every_microbatch_on_every_device():
    layout = decide_layout(None, CompileOptions(microbatches=4, parallel="pp"), 2, lambda: 16)
    assert layout.parallel == "pp"
    assert layout.device_microbatches == ((0, 1, 2, 3), (0, 1, 2, 3))
    assert layout.update_arrivals == 1  # a pack lives on one device
    assert layout.describe() == "4 microbatch(es) (sizes 4, 4, 4, 4), pipeline"


def test_several_devices_default_to_one_microbatch_each_in_data_parallel():
    layout = decide_layout(None, CompileOptions(), 3, lambda: 12)
    assert layout.parallel == "dp" and layout.num_microbatches == 3
    assert layout.device_microbatches == ((0,), (1,), (2,)) and layout.mb_sizes == (4, 4, 4)


@pytest.mark.parametrize("num_devices", [1, 2])
def test_larger_forward_microbatches_join_whole_backward_ones(num_devices):
    options = CompileOptions(microbatches={"forward": 2, "backward": 6})
    layout = decide_layout(None, options, num_devices, lambda: 20)
    backward = _sizes(20, 6)
    assert layout.mb_sizes == backward == (4, 4, 3, 3, 3, 3)
    assert layout.forward_parts == _cut(6, 2)
    # forward microbatch i is microbatch 6 + i, of the samples of the backward ones it joins
    assert layout.sizes == backward + (sum(backward[:3]), sum(backward[3:])) == backward + (11, 9)
    if num_devices == 1:
        assert layout.device_forward_parts(0) == ((6, (0, 1, 2)), (7, (3, 4, 5)))
    else:  # each device runs whole forward microbatches: their backward ones go with them
        assert layout.device_microbatches == ((0, 1, 2), (3, 4, 5))
        assert [layout.device_forward_parts(d) for d in range(2)] == [((6, (0, 1, 2)),), ((7, (3, 4, 5)),)]
    assert "the forward runs 2 of 11, 9" in layout.describe()


def test_the_planners_schedule_decides_over_the_options():
    schedule = Schedule(boundaries=(0, 2, 4), microbatches=4, parallel="pp", devices=2, forward_groups=(0, 4),
                        handoff="host")
    options = CompileOptions(microbatches=2, parallel="dp")
    layout = decide_layout(schedule, options, 2, lambda: 8)
    assert (layout.parallel, layout.num_microbatches, layout.mb_sizes) == ("pp", 4, (2, 2, 2, 2))
    assert layout.forward_groups == ((0, 2, 4), (0, 4)) and layout.handoff == "host"
    # a handoff the caller names wins over the schedule's
    layout = decide_layout(schedule, CompileOptions(handoff="peer"), 2, lambda: 8)
    assert layout.handoff == "peer"


def test_a_schedule_of_several_devices_on_one_is_single():
    schedule = Schedule(boundaries=(0, 2), microbatches=2, parallel="pp", devices=1)
    layout = decide_layout(schedule, CompileOptions(), 1, lambda: 8)
    assert layout.parallel == "single" and layout.update_arrivals == 1
    assert layout.device_microbatches == ((0, 1),)


def test_forward_groups_of_the_options_pair_with_their_pack_boundaries():
    options = CompileOptions(pack_boundaries=(0, 1, 2, 3), forward_groups=(0, 2))
    layout = decide_layout(None, options, 1, _unasked)
    assert layout.forward_groups == ((0, 1, 2, 3), (0, 2))


@pytest.mark.parametrize("microbatches,devices,parallel", [(3, None, "single"), (4, 2, "dp"), (4, 2, "pp")])
def test_a_compiled_module_runs_the_layout_of_the_batch_cut_here(microbatches, devices, parallel):
    torch.manual_seed(0)
    model = MLPChain(width=8, depth=4)
    x = torch.randn(10, 8)
    hm = harmony_fx.compile(model, (x,), microbatches=microbatches, pack_boundaries=(0, 2),
                            devices=None if devices is None else [f"host:{i}" for i in range(devices)],
                            parallel="auto" if parallel == "single" else parallel)
    layout = hm.compiled.layout
    assert layout.parallel == parallel and hm.mb_sizes == list(_sizes(10, microbatches))
    expected = _cut(microbatches, devices) if parallel == "dp" else (tuple(range(microbatches)),) * (devices or 1)
    assert layout.device_microbatches == expected
    # every size the layout names has its own graph, and the output joins back to the whole batch
    assert set(hm.compiled.packs_by_size) == set(layout.sizes)
    torch.testing.assert_close(hm(x), model(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("batch,num_devices,parallel", [(1, 1, "single"), (3, 1, "single"), (3, 2, "dp"),
                                                        (1, 2, "pp"), (1, 3, "pp")])
def test_a_batch_smaller_than_the_microbatches_runs_one_sample_each(batch, num_devices, parallel):
    """A loader's last batch: fewer samples than ``microbatches=4``. Each sample is a microbatch;
    where they are fewer than the devices, each device runs its packs on each (a pipeline), as
    data parallelism would leave a device idle."""
    layout = decide_layout(None, CompileOptions(microbatches=4, parallel="dp" if num_devices > 1 else "auto"),
                           num_devices, lambda: batch)
    assert layout.num_microbatches == batch and layout.parallel == parallel
    assert layout.mb_sizes == ((None,) if batch == 1 else _sizes(batch, batch))


def test_microbatches_fewer_than_the_devices_asked_for_are_still_refused():
    """Not a short batch: the user's own setting, which data parallelism cannot run."""
    with pytest.raises(ValueError, match="fewer than the 2 devices.*parallel='pp'"):
        decide_layout(None, CompileOptions(microbatches=1, parallel="dp"), 2, lambda: 8)


@pytest.mark.parametrize("num_devices, num", [(2, 1), (3, 2)])
def test_fewer_microbatches_than_devices_with_parallel_left_to_choose_run_as_a_pipeline(num_devices, num):
    """parallel="auto" (a Trainer's gradient accumulation of 1 on two devices): not data parallelism,
    which would leave a device without a microbatch."""
    layout = decide_layout(None, CompileOptions(microbatches=num), num_devices, lambda: 8)
    assert layout.parallel == "pp" and layout.num_microbatches == num
    assert layout.device_microbatches == (tuple(range(num)),) * num_devices


@pytest.mark.parametrize("devices", [1, 2])
def test_a_compiled_module_trains_like_eager_on_a_last_batch_smaller_than_its_microbatches(devices):
    torch.manual_seed(0)
    model = MLPChain(width=8, depth=4)
    reference = MLPChain(width=8, depth=4)
    reference.load_state_dict(model.state_dict())
    hm = harmony_fx.compile(model, microbatches=4, devices=[f"host:{i}" for i in range(devices)])
    for batch in (8, 1, 3):
        x = torch.randn(batch, 8)
        hm(x).square().sum().backward()
        reference(x).square().sum().backward()
        for param, expected in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(param.grad, expected.grad, rtol=1e-5, atol=1e-6)
            param.grad = expected.grad = None
