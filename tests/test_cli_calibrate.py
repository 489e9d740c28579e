"""``harmony-fx calibrate``: shows this machine's figures and their checks, measures them again when
they fail (a poisoned cache), and ``--refresh`` replaces them. The measurements are replaced by fixed
figures (``tests/test_calibrate.py``'s ``machine``): what is checked is what is shown and stored."""
from __future__ import annotations

from harmony_fx import calibrate
from harmony_fx.cli import main
from tests.helpers import POISONED, QUIET, calibration


def test_calibrate_shows_a_plausible_calibration_without_measuring(machine, capsys) -> None:  # noqa: F811
    machine.store(calibration(QUIET))
    assert main(["calibrate"]) == 0
    out, err = capsys.readouterr()
    assert machine.calls == 0
    assert calibrate.cache_key() in out and str(machine.path) in out
    assert "stored, plausible, and a quick re-measure agrees" in out
    assert "fp32" in out and "87.000 GFLOP/s" in out and "copy" in out and "19.000 GB/s" in out
    assert "task" in out and "170.000 us" in out and "spread 1.10x, load 0.20 per core" in out
    assert err == ""


def test_calibrate_measures_a_poisoned_calibration_again(machine, capsys) -> None:  # noqa: F811
    machine.store(calibration(POISONED))
    assert main(["calibrate"]) == 0
    out, _ = capsys.readouterr()
    assert machine.calls == 1 and machine.stored().figures == QUIET
    assert "measured again (fp32 measures 41x faster now than stored" in out and "87.000 GFLOP/s" in out


def test_calibrate_says_once_that_a_remeasure_is_still_doubtful(machine, capsys, recwarn) -> None:  # noqa: F811
    machine.measured = [calibration(QUIET, load=2.5)]
    assert main(["calibrate"]) == 0
    _, err = capsys.readouterr()
    assert "doubtful: fp32 was measured under a load of 2.5 per core" in err and not recwarn.list


def test_calibrate_refresh_replaces_the_figures_and_says_when_they_are_doubtful(machine, capsys) -> None:  # noqa: F811
    machine.store(calibration(QUIET))
    machine.measured = [calibration(POISONED, spread=3.0)]  # measured while the machine is busy
    assert main(["calibrate", "--refresh"]) == 0
    out, err = capsys.readouterr()
    assert machine.calls == 1 and machine.stored().figures == POISONED
    assert "measured and stored" in out and "2.100 GFLOP/s" in out
    assert "doubtful: fp32's trials were 3.0x apart" in err and "--refresh` when the machine is quiet" in err
