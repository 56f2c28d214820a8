"""`python -m joader.verify`: argument parsing, exit codes and the printed tables."""

from __future__ import annotations

import pytest
from pyroaring import BitMap

from joader.errors import InvalidArgumentError
from joader.verify import main, parse_job

pytestmark = pytest.mark.timeout(60)


def test_parse_job_ranges_and_ids() -> None:
    assert parse_job("a=0:3") == ("a", BitMap([0, 1, 2]))
    assert parse_job("c=0:2,10:12,99") == ("c", BitMap([0, 1, 10, 11, 99]))
    for bad in ("a", "=0:3", "a=", "a=3:1", "a=x:4", "a=-1:4"):
        with pytest.raises(InvalidArgumentError):
            parse_job(bad)


def test_two_jobs_pass_and_print_the_bound(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--job", "a=0:20", "--job", "b=10:30", "--epochs", "60", "--sit-out", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "a/b" in out and "0.5000" in out and "all checks pass" in out


def test_three_jobs_and_independent(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--job", "a=0:20", "--job", "b=0:20", "--job", "c=5:25,40", "--epochs", "40"]
    assert main(argv) == 0
    assert "whole suffix" in capsys.readouterr().out
    assert main([*argv, "--sampler", "independent"]) == 0
    assert "vs chance" in capsys.readouterr().out


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--job", "a=0:5x"]) == 2
    assert "bad range '0:5x'" in capsys.readouterr().err
    assert main(["--job", "a=0:5", "--job", "a=0:6"]) == 2
    assert main(["--job", "a=0:5", "--sit-out", "1"]) == 2
