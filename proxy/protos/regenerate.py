"""Regenerate the committed protobuf and grpclib modules from the .proto files in this folder.

The generated files are committed so that running the proxy needs no protoc; this script keeps them
reproducible. Run from anywhere: ``python -m proxy.protos.regenerate``. It needs grpcio-tools (test extra)
and grpclib's protoc plugin, both installed in the project's virtual environment.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

PROTOS = ("generate.proto", "kserve_v2.proto", "admin.proto")


def main() -> int:
    from grpc_tools import protoc  # imported here: only needed to regenerate, not at run time

    here = Path(__file__).resolve().parent
    root = here.parent.parent  # compile relative to the repository root so modules import as proxy.protos.*
    plugin = Path(sys.executable).with_name("protoc-gen-grpclib_python")
    if not plugin.exists():
        found = shutil.which("protoc-gen-grpclib_python")
        if found is None:
            print("protoc-gen-grpclib_python not found (pip install grpclib)", file=sys.stderr)
            return 1
        plugin = Path(found)
    include = Path(protoc.__file__).resolve().parent / "_proto"
    args = [
        "protoc",
        f"-I{root}",
        f"-I{include}",
        f"--plugin=protoc-gen-grpclib_python={plugin}",
        f"--python_out={root}",
        f"--pyi_out={root}",
        f"--grpclib_python_out={root}",
        *(str((here / name).relative_to(root)) for name in PROTOS),
    ]
    code = protoc.main(args)
    if code != 0:
        print(f"protoc failed with exit code {code}", file=sys.stderr)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
