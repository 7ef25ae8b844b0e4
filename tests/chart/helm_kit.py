"""The chart rendered and linted by real helm (issue 28): the pinned helm that
scripts/install-helm.sh installs (``make helm``) at ``<repo>/.cache/helm/bin/helm``, or
``$CUINTERPOSE_HELM``.

helm runs with its cache, config and data folders in a private temporary folder and no
kubeconfig (nothing here talks to a cluster): the release is ``cuinterpose`` in
``cuinterpose-system``. Values overrides are passed as a values file (``-f``), as a user's
would be, after the chart's values.yaml.

- ``template(values, skip_schema=False)``: ``helm template``'s output (str);
- ``render(values, skip_schema=False)``: {kind: [objects]} of that output;
- ``notes(values)``: NOTES.txt as ``helm install --dry-run=client`` renders it (``helm
  template`` does not render notes);
- ``lint(values_file)``: ``helm lint --strict``'s output.

Each raises :class:`HelmError` (helm's stderr, trimmed) when helm fails: the schema's
messages (helm validates values.schema.json before it renders any template) or a template's
``fail``/``required`` ("execution error at (cuinterpose/templates/FILE:LINE:COL): ...").
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import tempfile

import yaml

REPO = pathlib.Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "cuinterpose"
RELEASE, NAMESPACE = "cuinterpose", "cuinterpose-system"


class HelmError(Exception):
    """helm exited non-zero; ``str()`` is its stderr without the trailing hint lines."""


def helm_path() -> pathlib.Path:
    p = pathlib.Path(
        os.environ.get("CUINTERPOSE_HELM") or REPO / ".cache" / "helm" / "bin" / "helm"
    )
    if not os.access(p, os.X_OK):
        raise FileNotFoundError(f"no helm at {p}: run `make helm` (bash scripts/install-helm.sh)")
    return p


def helm(*args: str, values: dict | None = None) -> str:
    """Run helm with ``args`` (and ``-f <values as a file>``); its stdout."""
    with tempfile.TemporaryDirectory(prefix="cui-helm-") as home:
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": home,
            "HELM_CACHE_HOME": f"{home}/cache",
            "HELM_CONFIG_HOME": f"{home}/config",
            "HELM_DATA_HOME": f"{home}/data",
            "KUBECONFIG": f"{home}/no-kubeconfig",
        }
        extra = []
        if values is not None:
            vf = pathlib.Path(home) / "values.yaml"
            vf.write_text(json.dumps(values))  # JSON is YAML
            extra = ["-f", str(vf)]
        res = subprocess.run(
            [str(helm_path()), *args, *extra],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
        )
    if res.returncode != 0:
        err = res.stderr.replace("\nUse --debug flag to render out invalid YAML", "")
        raise HelmError(err.strip())
    return res.stdout


def template(values: dict | None = None, *, skip_schema: bool = False) -> str:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    return helm(*args, *(["--skip-schema-validation"] if skip_schema else []), values=values)


def render(values: dict | None = None, *, skip_schema: bool = False) -> dict[str, list[dict]]:
    """{kind: [objects]} of every manifest helm rendered."""
    docs: dict[str, list[dict]] = {}
    for d in yaml.safe_load_all(template(values, skip_schema=skip_schema)):
        if d is not None:
            docs.setdefault(d["kind"], []).append(d)
    return docs


def notes(values: dict | None = None) -> str:
    out = helm(
        "install",
        RELEASE,
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--dry-run=client",
        "-o",
        "json",
        values=values,
    )
    return json.loads(out)["info"]["notes"]


def lint(values_file: pathlib.Path | None = None) -> str:
    args = ["lint", "--strict", str(CHART), "--namespace", NAMESPACE]
    return helm(*args, *(["-f", str(values_file)] if values_file else []))


def schema_errors(values: dict) -> list[str]:
    """The lines helm prints for values that fail values.schema.json (``- at '/path': why``,
    nested ones indented; siblings in no fixed order), or [] when the values pass the schema."""
    try:
        template(values)
    except HelmError as e:
        head = "Error: values don't meet the specifications of the schema(s) in the following chart(s):\ncuinterpose:\n"
        text = str(e)
        if not text.startswith(head):
            return []  # the schema passed; a template refused (see template(skip_schema=True))
        return text[len(head) :].splitlines()
    return []
