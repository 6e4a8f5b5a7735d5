"""Generates the Python stubs of protos/*.proto into a folder (default: protos/ itself).

    python -m protos.generate [OUT_DIR]

grpc_tools writes `import tandem_pb2`; we rewrite it to `from protos import tandem_pb2` so the stubs
import as a package. tests/unit/test_protos.py regenerates into a temporary folder and fails on drift.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_DIR = Path(__file__).resolve().parent


def generate(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    protos = sorted(PROTO_DIR.glob("*.proto"))
    args = ["grpc_tools.protoc", f"-I{PROTO_DIR}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", *map(str, protos)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed for {protos}")
    written = []
    for proto in protos:
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            path = out_dir / f"{proto.stem}{suffix}"
            text = re.sub(rf"^import {proto.stem}_pb2 as", f"from protos import {proto.stem}_pb2 as",
                          path.read_text(), flags=re.M)
            path.write_text(text)
            written.append(path)
    return written


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_DIR)
