"""Case 013 (shared/cases/013-bad-numbers-and-paths): out-of-range numbers and over-long paths
came back as internal errors (exit 5 "rollback_failed", raw Python text) and left a created
parent directory behind.

Kind: a request's fields used before they are checked. Fixed (agent/validate.py, called by the
CLI and the gRPC service before anything happens): each field is checked and a refusal is
exit 3 "refused", phase "request", naming the field and the allowed range; nothing is created.
(The manifest's ENOSPC part of the case is in snapshot/manifest.py, another area.)
"""

from __future__ import annotations

import pytest

from cuinterpose.agent import validate
from cuinterpose.agent.errors import AgentError
from cuinterpose.workloads.afdwin import demo

SECONDS = "must be a finite number of seconds, more than 0 and at most 86400"


def checkpoint(tmp_path, images_dir, *extra):
    return demo.run_agent(
        "checkpoint", "--pid", "1", "--images-dir", images_dir, "--driver", "fake", *extra
    )


def test_an_images_dir_over_path_max_is_refused_and_nothing_is_created(tmp_path):
    d = str(tmp_path / "missing" / ("x" * 300))
    rc, out = checkpoint(tmp_path, d)
    assert rc == 3, out
    e = out["error"]
    assert (e["phase"], e["outcome"]) == ("request", "refused")
    assert e["reason"] == (
        f"images_dir has a component of 300 bytes ({'x' * 24}…): the limit is 255 (NAME_MAX)"
    )
    assert not (tmp_path / "missing").exists()
    d = str(tmp_path) + "/" + "/".join(["y" * 200] * 25)
    rc, out = checkpoint(tmp_path, d)
    assert rc == 3, out
    n = len(d.encode())
    assert (
        out["error"]["reason"]
        == f"images_dir is {n} bytes long (absolute): the limit is 4095 (PATH_MAX)"
    )


@pytest.mark.parametrize(
    "field,value,reason",
    [
        ("phase_timeout_s", float("nan"), f"phase_timeout_s nan is out of range: {SECONDS}"),
        ("phase_timeout_s", float("inf"), f"phase_timeout_s inf is out of range: {SECONDS}"),
        ("carrier_timeout_s", 1e300, f"carrier_timeout_s 1e+300 is out of range: {SECONDS}"),
        (
            "lock_timeout_ms",
            -1,
            "lock_timeout_ms -1 is out of range: must be an integer from 0 to 86400000 "
            "(milliseconds; 0 = none)",
        ),
        (
            "lock_timeout_ms",
            2**62,
            f"lock_timeout_ms {2**62} is out of range: must be an integer from 0 to 86400000 "
            "(milliseconds; 0 = none)",
        ),
    ],
)
def test_out_of_range_numbers_name_the_field_and_range(field, value, reason):
    with pytest.raises(AgentError) as ei:
        validate.checkpoint_request(roots=[1], images_dir="/tmp/x", **{field: value})
    assert (ei.value.phase, ei.value.reason, ei.value.outcome) == ("request", reason, "refused")


def test_cli_nan_and_huge_numbers_are_refused_exit_3(tmp_path):
    snap = str(tmp_path / "snap")
    for extra, reason in (
        (("--phase-timeout-s", "nan"), f"phase_timeout_s nan is out of range: {SECONDS}"),
        (("--carrier-timeout-s", "inf"), f"carrier_timeout_s inf is out of range: {SECONDS}"),
        (
            ("--lock-timeout-ms", str(2**62)),
            f"lock_timeout_ms {2**62} is out of range: must be an integer from 0 to 86400000 "
            "(milliseconds; 0 = none)",
        ),
    ):
        rc, out = checkpoint(tmp_path, snap, *extra)
        assert rc == 3, out
        e = out["error"]
        assert (e["phase"], e["outcome"], e["reason"]) == ("request", "refused", reason)
        assert not (tmp_path / "snap").exists()
