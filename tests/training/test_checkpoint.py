"""``Trainer`` checkpoints: a run resumed from ``save``/``load`` into a fresh trainer equals the
uninterrupted run bit for bit (dropout included); ``state_dict`` round trips; ``save`` is atomic;
a checkpoint of another model is refused. Checkpoint folders across processes
(``tests/distributed/launch.py``): a rank killed mid-step, then resumed from ``latest`` at 2, 3 and
1 processes."""
from __future__ import annotations

import os
import random
import shutil
import stat

import pytest
import torch
import torch.nn.functional as F

import harmony_fx
from harmony_fx.analysis.memory import eager_training_bytes
from harmony_fx.models import GPTConfig, MLPChain, TinyGPT
from harmony_fx.testing.models import zoo
from tests.distributed import launch, scenarios

STEPS = 6
BATCH = 8
GPT = GPTConfig(n_layer=4)  # the zoo's TinyGPT, half as deep: planning under a quarter of eager is faster
LOSS_FN = zoo()["tiny_gpt"].loss_fn


def _gpt_batches() -> list[tuple]:
    """The example batch, then a different batch every step."""
    generator = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(1 + STEPS):
        idx = torch.randint(0, GPT.vocab_size, (BATCH, GPT.block_size), generator=generator)
        batches.append(((idx,), torch.roll(idx, shifts=-1, dims=1)))
    return batches


def _gpt_trainer(seed: int, example, budget: int, **options) -> harmony_fx.Trainer:
    """TinyGPT (dropout 0.1) with 2 microbatches and AdamW."""
    torch.manual_seed(seed)
    model = TinyGPT(GPT)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    return harmony_fx.Trainer(model, LOSS_FN, optimizer, example, microbatches=2, memory_budget=budget, **options)


@pytest.mark.parametrize("form", ["file", pytest.param("folder", marks=pytest.mark.slow)])  # folder: also across processes below
def test_resumed_run_equals_uninterrupted_run(tmp_path, form):
    """``form``: one file, or a folder of step folders (torch.distributed.checkpoint, as across
    processes) with its ``latest`` pointer."""
    example, *batches = _gpt_batches()
    path = tmp_path / "ckpt.pt"
    if form == "folder":
        path = tmp_path / "ckpt"
        path.mkdir()
    torch.manual_seed(0)
    inputs, target = example
    budget = int(eager_training_bytes(TinyGPT(GPT), inputs, lambda out: LOSS_FN(out, target)) * 0.25)

    trainer = _gpt_trainer(0, example, budget)
    try:
        assert len(trainer.hm.packs) >= 3  # the budget really splits the model
        losses = [trainer.step(batch).item() for batch in batches]
        params = [p.detach().clone() for p in trainer.model.parameters()]
        # the later trainers skip the search for a packing that fits: the same packs, found faster
        boundaries = tuple(min(pack.layers) for pack in trainer.hm.packs)
        packs = [pack.layers for pack in trainer.hm.packs]
    finally:
        trainer.close()

    first = _gpt_trainer(0, example, budget, pack_boundaries=boundaries)
    try:
        assert [pack.layers for pack in first.hm.packs] == packs
        resumed_losses = [first.step(batch).item() for batch in batches[:3]]
        first.save(path)
        if form == "folder":
            assert (path / "latest").read_text().strip() == "step_00000003"
    finally:
        first.close()

    # other initial weights, a fresh optimizer, and the global RNG reseeded: load restores all of them
    second = _gpt_trainer(1, example, budget, pack_boundaries=boundaries)
    try:
        second.load(path)
        assert second.step_count == 3
        resumed_losses += [second.step(batch).item() for batch in batches[3:]]
        assert second.step_count == STEPS
        resumed_params = list(second.model.parameters())
    finally:
        second.close()

    assert resumed_losses == losses
    assert len(resumed_params) == len(params)
    for param, expected in zip(resumed_params, params):
        assert torch.equal(param.detach(), expected)


def _mlp_trainer(width: int = 16, depth: int = 6, seed: int = 0):
    torch.manual_seed(seed)
    model = MLPChain(width=width, depth=depth)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(16, width, generator=generator)
    target = torch.randint(0, 10, (16,), generator=generator)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = harmony_fx.Trainer(model, F.cross_entropy, optimizer, (x, target),
                                 pack_boundaries=tuple(range(0, depth, 2)))
    return trainer, (x, target)


def test_state_dict_round_trip():
    trainer, batch = _mlp_trainer()
    try:
        for _ in range(2):
            trainer.step(batch)
        state = trainer.state_dict()
        assert state["step_count"] == 2
        assert all("momentum_buffer" in s for s in state["optimizer"]["state"].values())
        draws = (torch.rand(3), random.random())
        losses = [trainer.step(batch).item() for _ in range(2)]
        params = [p.detach().clone() for p in trainer.model.parameters()]

        # the steps above changed weights and momentum in place: the state dict holds copies
        masters = [t for pack in trainer.hm.host_state.masters for t in pack]
        trainer.load_state_dict(state)
        # restored into the tensors the compiled packs hold, not by replacing them
        assert [t for pack in trainer.hm.host_state.masters for t in pack] == masters
        assert all(any(t is p for t in masters) for p in trainer.model.parameters())
        assert trainer.step_count == 2
        assert torch.equal(torch.rand(3), draws[0]) and random.random() == draws[1]
        assert [trainer.step(batch).item() for _ in range(2)] == losses
        for param, expected in zip(trainer.model.parameters(), params):
            assert torch.equal(param.detach(), expected)
    finally:
        trainer.close()


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_trainer_is_not_copied_and_says_what_to_save_instead(how, tmp_path):
    """It failed deep inside on its threads' locks ("cannot pickle '_thread.lock' object")."""
    import copy

    trainer, batch = _mlp_trainer()
    try:
        trainer.step(batch)
        with pytest.raises(TypeError, match=r"not copied or pickled.*trainer\.save\(path\).*trainer\.load\(path\)"):
            copy.deepcopy(trainer) if how == "deepcopy" else torch.save(trainer, tmp_path / "trainer.pt")
    finally:
        trainer.close()


def test_save_is_atomic(tmp_path, monkeypatch):
    trainer, batch = _mlp_trainer()
    path = tmp_path / "ckpt.pt"
    try:
        trainer.step(batch)
        trainer.save(path)
        good = path.read_bytes()
        trainer.step(batch)

        real_save = torch.save

        def crash_mid_write(obj, f, *args, **kwargs):
            real_save(obj, f, *args, **kwargs)
            f.truncate(f.tell() // 2)  # half a checkpoint written, then the process "dies"
            raise RuntimeError("disk full")

        monkeypatch.setattr(torch, "save", crash_mid_write)
        with pytest.raises(RuntimeError, match="disk full"):
            trainer.save(path)
        monkeypatch.undo()

        assert os.listdir(tmp_path) == ["ckpt.pt"]  # no temporary file left behind
        assert path.read_bytes() == good
        trainer.load(path)
        assert trainer.step_count == 1
    finally:
        trainer.close()


@pytest.mark.parametrize("width,depth,message", [
    # the checkpoint (6 blocks of width 16) has blocks this model lacks
    (16, 4, r"not in the model: blocks\.4\.0\.bias, blocks\.4\.0\.weight, blocks\.5\.0\.bias"),
    (8, 6, r"blocks\.0\.0\.weight: checkpoint \(16, 16\) torch\.float32, model \(8, 8\)"),
], ids=["unexpected-keys", "shape"])
def test_load_refuses_another_model(tmp_path, width, depth, message):
    path = tmp_path / "ckpt.pt"
    trainer, _ = _mlp_trainer()
    try:
        trainer.save(path)
    finally:
        trainer.close()
    other, _ = _mlp_trainer(width=width, depth=depth, seed=3)
    try:
        before = {name: t.clone() for name, t in other.model.state_dict().items()}
        with pytest.raises(ValueError, match=message):
            other.load(path)
        # refused before anything changed
        assert other.step_count == 0 and not other.optimizer.state
        for name, t in other.model.state_dict().items():
            assert torch.equal(t, before[name]), name
    finally:
        other.close()


def test_checkpoint_gets_ordinary_file_permissions(tmp_path):
    torch.manual_seed(0)
    model = MLPChain(width=8, depth=2)
    x, target = torch.randn(4, 8), torch.randint(0, 10, (4,))
    trainer = harmony_fx.Trainer(model, torch.nn.functional.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1),
                                 ((x,), target), microbatches=1)
    path = tmp_path / "ckpt.pt"
    mask = os.umask(0o022)
    try:
        trainer.save(path)
    finally:
        os.umask(mask)
        trainer.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


# ---------------------------------------------------------------------- folders across processes


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An unbroken 2-rank run, and one whose rank 1 dies in step 3 (both save after every step)."""
    base = tmp_path_factory.mktemp("checkpoints")
    unbroken = launch.run("checkpointed", 2, base / "a", folder=str(base / "unbroken"))
    broken = launch.run("checkpointed", 2, base / "b", dying={1: 3}, folder=str(base / "broken"), die_in_step=3)
    return base, unbroken[0], broken[0]


@pytest.mark.slow  # keeps the default suite under 8 minutes on 2 cores (which run has it: tests/tiers.py)
def test_a_killed_rank_is_named_by_the_other_within_the_timeout(runs):
    base, _, survivor = runs
    assert survivor["step_count"] == 3  # the failed step was undone
    assert "rank(s) 1 did not report" in survivor["error"] and "step 3" in survivor["error"]
    assert survivor["seconds"] < 20  # the group's timeout: a dead peer is found well before it
    # the pointer names the last step every rank finished
    assert (base / "broken" / "latest").read_text().strip() == "step_00000003"


@pytest.mark.slow  # its fixture's two 2-rank runs take 25 s; the folder resume is in tests/distributed/test_tier.py
def test_resuming_at_two_ranks_gives_the_unbroken_losses_bitwise(runs, tmp_path):
    base, unbroken, _ = runs
    folder = tmp_path / "ck"
    shutil.copytree(base / "broken", folder)
    resumed = launch.run("checkpointed", 2, tmp_path / "out", folder=str(folder), resume=True)
    for rank in resumed:
        assert list(rank["losses"]) == [3, 4]
        assert all(torch.equal(rank["losses"][step], unbroken["losses"][step]) for step in (3, 4))


@pytest.mark.slow  # keeps the default suite under 8 minutes on 2 cores (which run has it: tests/tiers.py)
def test_resuming_at_three_ranks_and_in_one_process_within_1e6(runs, tmp_path):
    base, unbroken, _ = runs
    folder = tmp_path / "ck3"
    shutil.copytree(base / "broken", folder)
    three = launch.run("checkpointed", 3, tmp_path / "out", folder=str(folder), resume=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = scenarios.single_resumed(str(base / "broken"))
    finally:
        torch.set_num_threads(threads)
    for result in [*three, single]:
        assert list(result["losses"]) == [3, 4], result
        for step in (3, 4):
            torch.testing.assert_close(result["losses"][step], unbroken["losses"][step], rtol=1e-6, atol=1e-6)
