"""The smallest budget and the bytes a step moves, fp32 against ``precision="bf16"``, on Hugging
Face GPT-2 and Llama (4 blocks, random weights, one microbatch):

    OMP_NUM_THREADS=1 python benchmarks/bf16_budgets.py

Each compile is at the smallest budget its refusal of one byte names; a row also says whether the
bytes measured in the step equal the plan's.
"""
from __future__ import annotations

import copy

import harmony_fx
from harmony_fx.testing.hf_models import build_hf_model, hf_batch


def smallest_and_moved(model, batch, precision: str) -> tuple[int, int, int, bool]:
    options = dict(example_kwargs=batch, precision=precision, microbatches=1, devices=["host:0"])
    try:
        harmony_fx.compile(copy.deepcopy(model), (), memory_budget=1, **options)
        raise AssertionError("a budget of one byte was accepted")
    except harmony_fx.BudgetTooSmallError as refused:
        budget = refused.smallest_budget
    hm = harmony_fx.compile(copy.deepcopy(model), (), memory_budget=budget, **options)
    hm(**batch).loss.backward()
    moved = hm.stats.as_dict()["bytes_by_kind"]
    return budget, len(hm.packs), sum(moved.values()), moved == hm.plan.predicted_bytes


def main() -> None:
    print("| model | smallest budget fp32 / bf16 | packs | bytes moved per step fp32 / bf16 | as planned |")
    print("|---|---|---|---|---|")
    for arch in ("gpt2", "llama"):
        model, batch = build_hf_model(arch, num_layers=4), hf_batch(arch)
        (b32, p32, m32, ok32), (b16, p16, m16, ok16) = (smallest_and_moved(model, batch, p) for p in ("fp32", "bf16"))
        print(f"| {arch} | {b32:,} / {b16:,} B = {b16 / b32:.2f}x | {p32} / {p16} | {m32:,} / {m16:,} B = "
              f"{m16 / m32:.2f}x | {ok32 and ok16} |")


if __name__ == "__main__":
    main()
