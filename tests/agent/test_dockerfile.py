"""The agent image (Dockerfile) against the repository and the Helm chart. Docker cannot run
here: these checks read the files. Every path a COPY takes from the build context exists, the
image's entrypoint and command are the DaemonSet's command and args, and the shim lands where
the chart's init container copies it from."""

from __future__ import annotations

import json
import pathlib
import re

import yaml

REPO = pathlib.Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "cuinterpose"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    out, cur = [], ""
    for line in (REPO / "Dockerfile").read_text().splitlines():
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        cur += line
        word, _, rest = cur.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        cur = ""
    return out


def daemonset() -> str:
    return (CHART / "templates" / "daemonset.yaml").read_text()


def values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def test_every_copy_source_exists_in_the_build_context():
    ignored = [
        ln.strip().strip("/")
        for ln in (REPO / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.lstrip().startswith("#")
    ]
    copies = [rest for ins, rest in instructions() if ins == "COPY"]
    assert copies
    for rest in copies:
        args = rest.split()
        if any(a.startswith("--from") for a in args):
            continue
        srcs = [a for a in args if not a.startswith("--")][:-1]
        assert srcs, rest
        for src in srcs:
            p = REPO / src
            assert p.exists(), f"COPY {src}: {p} does not exist"
            top = src.strip("/").split("/")[0]
            assert top not in ignored, f"COPY {src} but .dockerignore excludes {top}"


def test_base_is_debian_bookworm_and_the_projects_scripts_install_everything():
    ins = instructions()
    assert [r for i, r in ins if i == "FROM"] == ["debian:bookworm"]
    runs = " ".join(r for i, r in ins if i == "RUN")
    assert "bash scripts/bootstrap-debian.sh" in runs
    assert "bash scripts/install-criu.sh" in runs
    assert "pip install --no-cache-dir ." in runs
    env = " ".join(r for i, r in ins if i == "ENV")
    assert "CUINTERPOSE_CRIU_CACHE=/opt/criu" in env  # where agent/criu.py finds CRIU
    assert re.search(r"PATH=/opt/venv/bin:", env)  # cuinterpose-agent on PATH
    assert "python3 -m venv /opt/venv" in runs


def test_entrypoint_and_command_match_the_daemonset():
    ins = dict(instructions())
    ds = daemonset()
    m = re.search(r"- name: agent\n(?:.*\n)*?\s+command: (\[.*\])\n\s+args:\n\s+(.*)\n", ds)
    assert m, "agent container command/args not found in daemonset.yaml"
    assert json.loads(ins["ENTRYPOINT"]) == json.loads(m.group(1)) == ["cuinterpose-agent"]
    assert "toYaml .Values.args" in m.group(2)
    assert json.loads(ins["CMD"]) == values()["args"]


def test_the_shim_is_where_the_init_container_copies_it_from():
    """install-shim runs `cuinterpose-agent shim-path` in the image (no CUINTERPOSE_LIB_DIR):
    the package's own lib dir, inside the venv the Dockerfile installs. The venv must not lie
    under shim.hostPath, which the agent container mounts over."""
    ds = daemonset()
    init = ds[ds.index("- name: install-shim") : ds.index("containers:\n        - name: agent")]
    assert 'src=$(dirname "$(cuinterpose-agent shim-path)")' in init
    assert "CUINTERPOSE_LIB_DIR" not in init
    for f in re.search(r"for f in (.*); do", init).group(1).split():
        assert (
            REPO / {"libcuinterpose.so": "interposer", "fakecuda/libcuda.so.1": "fakecuda"}[f]
        ).is_dir(), f
    runs = " ".join(r for i, r in instructions() if i == "RUN")
    assert "cuinterpose-agent shim-path" in runs
    assert 'fakecuda/libcuda.so.1"' in runs
    host = values()["shim"]["hostPath"].rstrip("/")
    assert not "/opt/venv".startswith(host + "/") and host != "/opt/venv"
