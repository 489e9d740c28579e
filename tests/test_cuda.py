"""The same properties on a real GPU (``CudaDevice``); skipped where there is none.

Measured bytes must equal the plan exactly, as on a HostDevice. Packs run as graphs here;
compiled packs, the GPU default, have their own test at the end. Peaks come from the caching
allocator (``torch.cuda.max_memory_allocated``), which rounds blocks to 512 bytes and holds library
workspaces, so they are checked against the budget with a relative slack, not equated with the
prediction. Both runs draw dropout from the same seeded CUDA generator, so dropout models are
compared too; TF32 is off, so fp32 means fp32.
"""
from __future__ import annotations

import copy
import re

import pytest
import torch

import harmony_fx
from harmony_fx.analysis.memory import eager_training_bytes
from harmony_fx.config import parse_size
from harmony_fx.testing.models import zoo
from tests.helpers import four_pack_trainer, regression_batches

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _no_tf32():
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


@pytest.mark.parametrize("name", ["mlp_chain", "residual_mlp", "tiny_gpt", "small_cnn"])
@pytest.mark.parametrize("fraction", [1.0, 0.25])
def test_compile_on_cuda_matches_eager(name, fraction):
    entry = zoo()[name]
    model, inputs, target = entry.build(0)
    reference = copy.deepcopy(model).cuda()
    budget = int(fraction * eager_training_bytes(model, inputs, lambda out: entry.loss_fn(out, target)))
    hm = harmony_fx.compile(model, inputs, devices=["cuda:0"], compile_packs=False,
                            memory_budget=budget, microbatches=1)
    # dropout draws from the GPU generator in both runs: seed it the same way for each
    torch.manual_seed(0)
    loss = entry.loss_fn(hm(*inputs), target)
    loss.backward()
    torch.manual_seed(0)
    reference_loss = entry.loss_fn(reference(*[x.cuda() for x in inputs]), target.cuda())
    reference_loss.backward()
    torch.testing.assert_close(loss, reference_loss.cpu(), rtol=1e-5, atol=1e-6)
    for (pname, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad.cpu(), rtol=1e-5, atol=1e-6, msg=pname)
    assert hm.stats.bytes_h2d == hm.plan.bytes_h2d
    assert hm.stats.bytes_d2h == hm.plan.bytes_d2h
    assert hm.stats.peak_bytes["cuda:0"] <= budget * 1.05  # allocator rounding


def test_trainer_on_cuda_matches_eager_adamw():
    entry = zoo()["residual_mlp"]
    model, inputs, target = entry.build(0)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    budget = int(0.25 * eager_training_bytes(model, inputs, lambda out: entry.loss_fn(out, target)))
    trainer = harmony_fx.Trainer(model, entry.loss_fn, optimizer, (inputs, target), devices=["cuda:0"],
                                 compile_packs=False, memory_budget=budget)
    for _ in range(3):
        torch.manual_seed(0)
        loss = trainer.step((inputs, target))
        torch.manual_seed(0)
        reference_loss = entry.loss_fn(reference(*inputs), target)
        reference_loss.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        torch.testing.assert_close(loss, reference_loss.detach(), rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    trainer.close()


# ---------------------------------------------------------------------- the GPU path's own properties


def _gpt(dropout: float = 0.0):
    from harmony_fx.models import GPTConfig, TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=96, block_size=32, n_layer=6, n_head=4, n_embd=64, dropout=dropout))
    return model, torch.randint(0, 96, (8, 32)), torch.randint(0, 96, (8, 32))


def _gpt_loss(logits, target):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten().to(logits.device))


def _assert_grads(model, reference, rtol=1e-5, atol=1e-6):
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad.cpu(), rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("parallel", ["dp", "pp"])
def test_two_cuda_devices_on_one_gpu_match_eager(parallel):
    """Two controllers, events between them, factory ops on each device's own packs."""
    model, x, y = _gpt()
    reference = copy.deepcopy(model).cuda()
    hm = harmony_fx.compile(model, x, devices=["cuda:0", "cuda:0"], compile_packs=False,
                            parallel=parallel, microbatches=4,
                            memory_budget="1MiB")
    for _ in range(2):  # a second iteration: what the allocator reuses from the first
        model.zero_grad()
        reference.zero_grad()
        _gpt_loss(hm(x), y).backward()
        _gpt_loss(reference(x.cuda()), y).backward()
        _assert_grads(model, reference)
    hm.close()


def test_cuda_inputs_are_copied_without_pinning():
    torch.manual_seed(0)
    from harmony_fx.models import MLPChain

    model = MLPChain(width=64, depth=8)
    reference = copy.deepcopy(model).cuda()
    x = torch.randn(16, 64, device="cuda")
    hm = harmony_fx.compile(model, x, devices=["cuda:0"], compile_packs=False,
                            microbatches=2, pack_boundaries=(0, 3, 6))
    hm(x).sum().backward()
    reference(x).sum().backward()
    _assert_grads(model, reference)


def test_a_model_moved_to_the_gpu_trains_with_its_weights_resident_and_a_fused_adamw():
    """What a GPU user writes for a model that fits: no weight crosses the bus, the results come back
    on the GPU, and the fused AdamW there steps the weights as it steps eager's."""
    from harmony_fx.models import MLPChain

    torch.manual_seed(0)
    model = MLPChain(width=64, depth=8).cuda()
    reference = copy.deepcopy(model)
    x = torch.randn(16, 64, device="cuda")
    hm = harmony_fx.compile(model, x, devices=["cuda:0"], compile_packs=False, microbatches=2,
                            pack_boundaries=(0, 3, 6))
    assert hm.compiled.resident_weights
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), fused=True)
    for _ in range(2):
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
        out = hm(x)
        assert out.device == x.device
        out.square().mean().backward()
        reference(x).square().mean().backward()
        _assert_grads(model, reference)
        optimizer.step()
        ref_optimizer.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    assert not {kind for _, kind in hm.stats.moved[0]} & {"weights", "wgrad"}


def test_a_model_on_the_gpu_is_refused_where_its_weights_cannot_stay():
    from harmony_fx.models import MLPChain

    model = MLPChain(width=16, depth=2).cuda()
    with pytest.raises(ValueError, match=r"is on cuda:0: harmony_fx keeps the model's weights in host memory.*model\.cpu\(\)"):
        harmony_fx.compile(model, torch.randn(4, 16), devices=["cuda:0"], compile_packs=False,
                           resident_weights=False)


def test_delays_on_the_copy_streams_leave_results_bitwise_unchanged():
    """Every copy waits for what it needs: slowing the copy streams changes no bit."""
    grads = []
    for delay in (0, 5_000_000):
        model, x, y = _gpt()
        hm = harmony_fx.compile(model, x, devices=["cuda:0"], compile_packs=False,
                                microbatches=2, memory_budget="512KiB")
        streams, submit = hm.devices[0].streams, hm.devices[0].streams.submit

        def slow(stream, work, _submit=submit, _delay=delay):
            if _delay and stream.value in ("h2d", "d2h", "peer"):
                with torch.cuda.stream(streams.stream(stream)):
                    torch.cuda._sleep(_delay)
            return _submit(stream, work)

        streams.submit = slow
        _gpt_loss(hm(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_bf16_on_cuda_is_close_to_fp32_and_moves_what_it_planned():
    model, x, y = _gpt()
    reference = copy.deepcopy(model).cuda()
    hm = harmony_fx.compile(model, x, devices=["cuda:0"], compile_packs=False, microbatches=2, precision="bf16")
    loss = _gpt_loss(hm(x).float(), y)
    loss.backward()
    ref_loss = _gpt_loss(reference(x.cuda()), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach().cpu(), rtol=2e-2, atol=0)
    assert hm.stats.as_dict()["bytes_by_kind"] == hm.plan.predicted_bytes
    assert hm.devices[0].staging.allocations > 0  # the bf16 casts went into reused pinned buffers


def test_allocator_peaks_within_the_budget_over_two_iterations():
    """The requested bytes (what the program asked for) stay within the budget; allocated adds the
    allocator's rounding, which the plan's reserve covers."""
    model, x, y = _gpt()
    budget = 2 << 20
    hm = harmony_fx.compile(model, x, devices=["cuda:0"], compile_packs=False, microbatches=2, memory_budget=budget)
    for _ in range(2):
        _gpt_loss(hm(x), y).backward()
        peaks = hm.stats.memory_peaks["cuda:0"]
        assert set(peaks) == {"allocated", "requested", "reserved"}
        assert peaks["requested"] <= peaks["allocated"] == hm.stats.peak_bytes["cuda:0"] <= budget


def test_spans_are_gpu_time_not_issue_time():
    """A copy stream held up on the GPU for ~25 ms: the spans (CUDA timing events) show the
    prefetches starting after the hold-up, where the host issued them at once."""
    model, x, y = _gpt()
    hm = harmony_fx.compile(model, x, devices=["cuda:0"], compile_packs=False,
                            microbatches=2, memory_budget="512KiB", timeline=True)
    _gpt_loss(hm(x), y).backward()  # warm up: the allocator, cuBLAS
    streams, submit = hm.devices[0].streams, hm.devices[0].streams.submit
    held = []

    def held_up(stream, work):
        if stream.value == "h2d" and not held:
            held.append(stream)
            with torch.cuda.stream(streams.stream(stream)):
                torch.cuda._sleep(50_000_000)  # tens of ms on any recent GPU
        return submit(stream, work)

    streams.submit = held_up
    model.zero_grad()
    _gpt_loss(hm(x), y).backward()
    first_prefetch = min(start for _, stream, _, start, _ in hm.stats.spans if stream == "h2d")
    assert first_prefetch > 5e-3


def test_compiled_packs_on_cuda_replay_dropout_like_eager():
    """The GPU default: packs compiled by inductor, random ops as eager's kernels on the GPU's
    generator, so each block's recompute draws the forward's masks."""
    model, x, y = _gpt(dropout=0.2)
    reference = copy.deepcopy(model).cuda()
    hm = harmony_fx.compile(model, x, devices=["cuda:0"], microbatches=1, memory_budget="1MiB")
    assert hm.session.pack_compiler is not None and len(hm.packs) > 2
    torch.manual_seed(0)
    loss = _gpt_loss(hm(x), y)
    loss.backward()
    torch.manual_seed(0)
    reference_loss = _gpt_loss(reference(x.cuda()), y)
    reference_loss.backward()
    torch.testing.assert_close(loss, reference_loss.detach().cpu(), rtol=1e-5, atol=1e-6)
    _assert_grads(model, reference)
    assert hm.session.pack_compiler.structures < len(hm.packs)


def test_fp32_masters_on_the_tier_leave_pinned_bf16_copies_that_no_device_stages(tmp_path):
    """With the masters on the NVMe tier, each parameter holds a pinned bf16 copy, which the device's
    weight copies read as it is: no staging buffer for it, as the plan counts."""
    batch = (torch.randn(16, 32), torch.randn(16, 4))

    def trainer(**options):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(23)], torch.nn.Linear(32, 4))
        return harmony_fx.Trainer(model, torch.nn.functional.mse_loss, torch.optim.AdamW(model.parameters()), batch,
                                  microbatches=2, pack_boundaries=(0, 6, 12, 18), precision="bf16",
                                  devices=["cuda:0"], **options)

    with pytest.raises(ValueError, match="raise host_memory to at least") as refused:
        trainer(nvme_path=tmp_path / "refused", host_memory="1KiB")
    least = parse_size(re.search(r"at least ([\d.]+ \w+)", str(refused.value)).group(1)) + 2**20
    tiered = trainer(nvme_path=tmp_path / "tier", host_memory=least)
    assert tiered.plan.tier_master_packs == (0, 1, 2, 3)
    tiered.step(batch)
    tiered.flush()
    assert all(p.dtype == torch.bfloat16 and p.is_pinned() for p in tiered.model.parameters())
    assert sum(device.staging.nbytes for device in tiered.hm.devices) == 0 == tiered.hm.compiled.host_memory.needs.weight_copies


def test_trainer_steps_land_gradients_in_one_set_of_pinned_buffers():
    """Each step's weight gradients land in the pinned tensors of the last step's (``.grad``): the
    same storages every step (before, new ones while the last step's were still held), and from
    the second step on (the undo copies and optimizer state exist) no pinned bytes added a step."""
    trainer = four_pack_trainer(devices=["cuda:0"], compile_packs=False)  # four packs, no tied weight
    model = trainer.model
    stats = getattr(torch.cuda, "host_memory_stats", None)  # older torch has no host allocator statistics
    try:
        assert len(trainer.hm.packs) == 4
        pinned, storages = [], []
        for batch in regression_batches(3):
            trainer.step(batch)
            if stats is not None:
                pinned.append(stats()["allocated_bytes.current"])
            storages.append([p.grad.untyped_storage().data_ptr() for p in model.parameters()])
        assert all(p.grad.is_pinned() for p in model.parameters())
        assert storages[0] == storages[1] == storages[2]
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        if stats is not None:
            assert pinned[1] == pinned[2] >= grad_bytes
    finally:
        trainer.close()
