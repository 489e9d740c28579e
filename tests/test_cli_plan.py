"""``harmony-fx plan``: the command line of the planner (``harmony_fx/commands/plan.py``)."""
from __future__ import annotations

import json

import pytest

from harmony_fx.cli import main
from harmony_fx.config import format_size
from harmony_fx.planner.presets import preset_profile
from harmony_fx.planner.search import host_bytes
from harmony_fx.planner.specs import PRESETS, HostSpec


def _refused(constant: str):
    raise AssertionError(f"{constant} is not JSON")


def test_a_packing_that_does_not_fit_is_null_in_the_json_not_infinity() -> None:
    from harmony_fx.commands.plan import _finite

    report = {"compared_seconds": {"largest packs": 894.3, "one layer per pack": float("inf")}, "nan": [float("nan")]}
    assert json.loads(json.dumps(_finite(report), allow_nan=False)) == {
        "compared_seconds": {"largest packs": 894.3, "one layer per pack": None}, "nan": [None]}


def test_plan_json_and_trace(tmp_path, capsys) -> None:
    trace = tmp_path / "plan.json"
    code = main(["plan", "gpt2-xl", "--devices", "2", "--device-spec", "v100-32gb", "--json", "--trace", str(trace)])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out, parse_constant=_refused)  # stdout is the JSON alone: progress goes to stderr
    assert {"iteration_seconds", "packs", "bytes_moved", "peak_bytes", "bound_by"} <= set(report)
    assert report["model"] == "gpt2-xl" and report["device_spec"] == "v100-32gb"
    assert report["iteration_seconds"] >= report["lower_bound_seconds"] > 0
    assert report["bound_by"] in ("compute", "bus", "host optimizer", "tier")
    assert report["packs"] and sum(pack["num_layers"] for pack in report["packs"]) == report["layers"]
    assert sum(pack["params"] for pack in report["packs"]) == report["parameters"]
    assert len(report["peak_bytes"]) == report["devices"] <= 2
    assert max(report["peak_bytes"]) <= PRESETS["v100-32gb"].memory
    assert report["bytes_moved"]["h2d/weights"] > 0 and report["bytes_moved"]["d2h/wgrad"] > 0
    assert report["trace"] == str(trace)
    assert "planning gpt2-xl" in err
    schedule = report["schedule"]  # Harmony's four choices
    assert schedule["backward_microbatches"] == report["microbatches"]
    assert schedule["backward_packs"] == len(report["packs"])
    assert 1 <= schedule["forward_microbatches"] <= schedule["backward_microbatches"]
    assert 1 <= schedule["forward_packs"] <= schedule["backward_packs"]

    events = json.loads(trace.read_text())["traceEvents"]
    rows = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    slices = [e for e in events if e["ph"] == "X"]
    for stream in ("compute", "h2d"):
        assert any(rows[(e["pid"], e["tid"])] == stream for e in slices), stream
    assert all(e["cat"] == rows[(e["pid"], e["tid"])] for e in slices)
    assert max(e["ts"] + e["dur"] for e in slices) == pytest.approx(report["iteration_seconds"] * 1e6, rel=1e-6)


def test_plan_text_output(capsys) -> None:
    code = main(["plan", "bert-large", "--device-spec", "v100-32gb", "--batch-size", "16"])
    out, _ = capsys.readouterr()
    assert code == 0
    assert "predicted iteration" in out
    assert "lower bound" in out and "Harmony's Ufwd" in out and "Pbwd" in out
    assert "planning bert-large" in out and "batch 16" in out
    table = [line for line in out.splitlines() if line.startswith("pack ")]
    assert len(table) == 1 and "layers" in table[0] and "stash" in table[0]


def test_unknown_device_spec_exits_2_with_a_message(capsys) -> None:
    code = main(["plan", "gpt2-xl", "--device-spec", "tpu-v9"])
    out, err = capsys.readouterr()
    assert code == 2
    assert "tpu-v9" in err and "v100-32gb" in err
    assert "predicted" not in out


def test_unknown_model_exits_2_with_a_message(capsys) -> None:
    code = main(["plan", "gpt5"])
    _, err = capsys.readouterr()
    assert code == 2
    assert "gpt5" in err and "file.py:function" in err


def test_host_memory_too_small_exits_2_naming_what_is_needed(capsys) -> None:
    code = main(["plan", "gpt3-175b", "--host-memory", "2TB", "--json"])
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    message = err.strip().splitlines()[-1]
    assert message.startswith("harmony-fx plan:")
    assert "host memory" in message
    profile, batch = preset_profile("gpt3-175b")
    needed = host_bytes(profile, [], batch, HostSpec(optimizer_state_bytes=8))  # Adam, the default
    assert needed > 2 * 10**12
    assert format_size(needed) in message
    assert format_size(2 * 10**12) in message  # what was given


def test_plan_across_servers_reports_the_network_and_picks_a_layout(capsys) -> None:
    code = main(["plan", "gpt2-xl", "--devices", "2", "--nodes", "4", "--network", "100Gbit", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    network = json.loads(out)["network"]
    assert network["nodes"] == 4 and network["bandwidth_bytes_per_second"] == 100e9 / 8
    assert set(network["compared_seconds"]) == {"sharded", "replicated"}
    assert network["optimizer"] == min(network["compared_seconds"], key=network["compared_seconds"].get)
    # per server and iteration, fp32 gradients G: sharded, gloo's reduce-scatter 2(N-1)/N G and the
    # weights' all-gather (N-1)/N G; replicated, an all-reduce 2(N-1)/N G
    params = preset_profile("gpt2-xl", "bf16")[0].num_params
    expected = (2 * 0.75 + 0.75) * 4 * params if network["optimizer"] == "sharded" else 2 * 0.75 * 4 * params
    assert network["bytes_per_server"] == pytest.approx(expected, rel=1e-6)


def test_plan_network_speed_must_be_readable(capsys) -> None:
    assert main(["plan", "gpt2-xl", "--nodes", "2", "--network", "fast"]) == 2
    assert "--network" in capsys.readouterr().err


@pytest.mark.parametrize("argv,says", [
    (["plan", "llama-7b", "--devices", "0"], "--devices: must be a positive whole number, got 0"),
    (["plan", "llama-7b", "--batch-size", "0"], "--batch-size: must be a positive whole number"),
    (["demo", "--budget-fraction", "0"], "--budget-fraction: must be a fraction in (0, 1], got 0"),
    (["demo", "--steps", "-1"], "--steps: must be a positive whole number"),
])
def test_a_number_out_of_range_is_refused_by_the_command_line(argv, says, capsys):
    """--devices 0 ended in a ZeroDivisionError's traceback, --batch-size 0 was ignored silently."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert says in capsys.readouterr().err


def test_measuring_this_machines_layers_for_another_device_is_refused(tmp_path, capsys) -> None:
    """--measure with --device-spec h100-80gb predicted an H100 from this CPU's layer times."""
    model_file = tmp_path / "model.py"
    model_file.write_text("import torch\n\ndef build():\n    return torch.nn.Linear(4, 4), (torch.randn(2, 4),)\n")
    code = main(["plan", f"{model_file}:build", "--measure", "--device-spec", "h100-80gb"])
    assert code == 2
    assert "--measure times every layer on this machine, which is not a h100-80gb" in capsys.readouterr().err
