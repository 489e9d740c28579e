"""Per-layer costs: what a task costs to issue from the host, added inline, overlapped on a GPU."""
from __future__ import annotations

import dataclasses

from harmony_fx.planner.costs import layer_seconds
from harmony_fx.planner.profile import LayerProfile
from harmony_fx.planner.specs import PRESETS, host_nominal


def _layer(num_ops: int, flops: float) -> LayerProfile:
    return LayerProfile("l0", 1000, 4000, flops, 1e3, 1e3, num_ops=num_ops)


def test_a_gpu_task_of_tiny_kernels_is_bound_by_issuing_them():
    spec = PRESETS["h200"]
    forward, backward = layer_seconds(_layer(num_ops=50, flops=1e3), 1, spec, "fp32")
    assert forward == 50 * spec.op_seconds and backward == 100 * spec.op_seconds


def test_a_gpu_task_of_large_kernels_hides_issuing_them():
    spec = PRESETS["h200"]
    alone = layer_seconds(_layer(num_ops=0, flops=1e12), 8, spec, "fp32")
    assert layer_seconds(_layer(num_ops=50, flops=1e12), 8, spec, "fp32") == alone


def test_an_inline_device_pays_issue_and_compute_in_turn():
    spec = dataclasses.replace(host_nominal(), op_seconds=1e-4)
    alone = layer_seconds(_layer(num_ops=0, flops=1e6), 1, spec, "fp32")
    forward, backward = layer_seconds(_layer(num_ops=10, flops=1e6), 1, spec, "fp32")
    assert forward == alone[0] + 10e-4 and backward == alone[1] + 20e-4
