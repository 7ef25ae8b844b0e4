"""agent/units.py: the one byte-count parser of the command line, the environment and the
benches; every accepted spelling gives its exact value, every refusal says what is accepted."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from cuinterpose.agent.cli.common import BytesType
from cuinterpose.agent.units import arg_bytes, parse_bytes


@pytest.mark.parametrize(
    "text,value",
    [
        ("8388608", 8 << 20),
        ("0x800000", 8 << 20),
        ("64KiB", 64 << 10),
        ("64 KiB", 64 << 10),
        ("64k", 64 << 10),
        ("256MiB", 256 << 20),
        ("256mib", 256 << 20),
        ("4GiB", 4 << 30),
        ("4G", 4 << 30),
        ("1TiB", 1 << 40),
        ("0", 0),
        (" 12 B ", 12),
        (4096, 4096),
    ],
)
def test_accepted_spellings(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize(
    "text,why",
    [
        ("8MB", "MB is ambiguous (10^3 or 2^10?): write MiB or bytes"),
        ("1gb", "gb is ambiguous (10^3 or 2^10?): write GiB or bytes"),
        ("1.5GiB", "write a number of bytes, or one with KiB, MiB, GiB or TiB (e.g. 256MiB)"),
        ("-1", "write a number of bytes, or one with KiB, MiB, GiB or TiB (e.g. 256MiB)"),
        ("lots", "write a number of bytes, or one with KiB, MiB, GiB or TiB (e.g. 256MiB)"),
        ("", "write a number of bytes, or one with KiB, MiB, GiB or TiB (e.g. 256MiB)"),
        ("0xZZ", "write a number of bytes, or one with KiB, MiB, GiB or TiB (e.g. 256MiB)"),
    ],
)
def test_refusals_name_the_text_and_what_is_accepted(text, why):
    with pytest.raises(ValueError) as e:
        parse_bytes(text)
    assert str(e.value) == f"{text!r} is not a byte count: {why}"


def test_negative_int_refused():
    with pytest.raises(ValueError, match="^-5 is not a byte count: it is negative$"):
        parse_bytes(-5)


def test_click_type_range_and_message():
    @click.command()
    @click.option("--staging-bytes", type=BytesType(64 << 10, 1 << 30))
    def cmd(staging_bytes):
        click.echo(staging_bytes)

    r = CliRunner()
    assert r.invoke(cmd, ["--staging-bytes", "256MiB"]).output == f"{256 << 20}\n"
    low = r.invoke(cmd, ["--staging-bytes", "4KiB"])
    assert low.exit_code == 2
    assert "4096 bytes: must be at least 65536 and at most 1073741824 bytes" in low.output
    bad = r.invoke(cmd, ["--staging-bytes", "8MB"])
    assert bad.exit_code == 2
    assert "'8MB' is not a byte count: MB is ambiguous" in bad.output


def test_argparse_type_shows_the_refusal(capsys):
    import argparse

    ap = argparse.ArgumentParser(prog="bench")
    ap.add_argument("--bytes", type=arg_bytes, action="append")
    assert ap.parse_args(["--bytes", "1GiB", "--bytes", "4096"]).bytes == [1 << 30, 4096]
    with pytest.raises(SystemExit):
        ap.parse_args(["--bytes", "4GB"])
    assert capsys.readouterr().err.endswith(
        "bench: error: argument --bytes: '4GB' is not a byte count: GB is ambiguous (10^3 or "
        "2^10?): write GiB or bytes\n"
    )


def test_the_carrier_settings_read_units_from_the_environment():
    """The variables are read by the options' constructor (agent/options.py), with units; the
    carriers take the values from the options."""
    from cuinterpose.agent.errors import AgentError
    from cuinterpose.agent.options import CheckpointOptions
    from cuinterpose.agent.run import carriers

    env = {"CUINTERPOSE_STAGING_BYTES": "128MiB", "CUINTERPOSE_CHUNK_BYTES": "4 MiB"}
    o = CheckpointOptions.from_environ(env)
    got = carriers.settings(**o.chunk_settings(), checksum="sha256")
    assert (got.chunk_bytes, got.staging_bytes) == (4 << 20, 128 << 20)
    o = CheckpointOptions.from_environ(env, {"staging_bytes": 1 << 30})
    assert carriers.settings(**o.chunk_settings()).staging_bytes == 1 << 30
    with pytest.raises(AgentError) as e:
        CheckpointOptions.from_environ({"CUINTERPOSE_STAGING_BYTES": "8MB"})
    assert (e.value.phase, e.value.reason) == (
        "request",
        "$CUINTERPOSE_STAGING_BYTES='8MB': '8MB' is not a byte count: MB is ambiguous (10^3 or "
        "2^10?): write MiB or bytes",
    )
    with pytest.raises(AgentError) as e:
        CheckpointOptions.from_environ({"CUINTERPOSE_WRITERS": "many"})
    assert e.value.reason == "$CUINTERPOSE_WRITERS='many': must be an integer"


def test_checkpoint_takes_a_unit_on_the_command_line():
    from cuinterpose.agent.cli import main

    r = CliRunner().invoke(main, ["checkpoint", "--staging-bytes", "8MB", "1"])
    assert r.exit_code == 2
    assert "'8MB' is not a byte count: MB is ambiguous" in r.output


def test_conflicting_sizes_name_each_value_and_where_it_came_from(monkeypatch):
    """Helper review, stop 21: --chunk-bytes 1GiB alone failed as "images dir: staging_bytes
    67108864 must be at least chunk_bytes", naming neither option."""
    from cuinterpose.agent.cli.common import flag_of
    from cuinterpose.agent.errors import AgentError
    from cuinterpose.agent.options import CheckpointOptions
    from cuinterpose.agent.run import carriers

    with pytest.raises(AgentError) as e:  # the command line's --chunk-bytes 1GiB
        CheckpointOptions.from_environ({}, {"chunk_bytes": 1 << 30}, label=flag_of)
    assert str(e.value) == (
        "request: --staging-bytes (the default) 67108864 must be at least --chunk-bytes "
        "(1073741824: the staging ring holds whole chunks) and at most 68719476736 bytes (64 GiB)"
    )
    with pytest.raises(AgentError) as e:
        CheckpointOptions.from_environ({"CUINTERPOSE_STAGING_BYTES": "1MiB"}, label=flag_of)
    assert e.value.reason.startswith(
        "$CUINTERPOSE_STAGING_BYTES 1048576 must be at least --chunk-bytes (the default) (8388608:"
    )
    with pytest.raises(AgentError) as e:  # the carriers check what they are given, too
        carriers.settings(chunk_bytes=1 << 30, checksum="sha256")
    assert str(e.value) == (
        "carrier settings: --staging-bytes (the default) 67108864 must be at least --chunk-bytes "
        "(1073741824: the staging ring holds whole chunks) and at most 68719476736 bytes (64 GiB)"
    )
    with pytest.raises(AgentError) as e:
        carriers.settings(chunk_bytes="3MiB", staging_bytes="64MiB", checksum="sha256")
    assert e.value.reason == (
        "--chunk-bytes 3145728 must be a power of two from 65536 to 1073741824 bytes "
        "(64 KiB to 1 GiB)"
    )
