"""Generate the Python protobuf/gRPC modules for proto/cuinterpose/v1/*.proto (build step).

Usage: ``python scripts/gen_proto.py PROTO_ROOT OUT_DIR``. Runs ``python -m grpc_tools.protoc``
with ``-I PROTO_ROOT`` and writes ``OUT_DIR/cuinterpose/v1/{name}_pb2.py`` and
``{name}_pb2_grpc.py``, then rewrites their imports of ``cuinterpose.v1`` to
``cuinterpose._proto.cuinterpose.v1`` (the modules are installed under the package, and
``cuinterpose`` itself is our package, not the proto namespace), and adds ``__init__.py`` files.
Exit status 1 with protoc's message on stderr when generation fails.
"""

from __future__ import annotations

import pathlib
import re
import sys


def main(argv: list[str]) -> int:
    root, out = pathlib.Path(argv[1]).resolve(), pathlib.Path(argv[2]).resolve()
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(root)) for p in (root / "cuinterpose" / "v1").glob("*.proto"))
    out.mkdir(parents=True, exist_ok=True)
    well_known = str(pathlib.Path(grpc_tools.__file__).parent / "_proto")
    rc = protoc.main(
        [
            "protoc",
            f"-I{root}",
            f"-I{well_known}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            *protos,
        ]
    )
    if rc != 0:
        print(f"gen_proto: protoc failed ({rc}) for {protos}", file=sys.stderr)
        return 1
    pkg = out / "cuinterpose" / "v1"
    for py in sorted(pkg.glob("*.py")):
        text = py.read_text()
        new = re.sub(
            r"^from cuinterpose\.v1 import ",
            "from cuinterpose._proto.cuinterpose.v1 import ",
            text,
            flags=re.M,
        )
        if new != text:
            py.write_text(new)
    for d in (out, out / "cuinterpose", pkg):
        (d / "__init__.py").touch()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
