"""Generate the Python gRPC stubs from protos/ into services/common/gen (never committed).

The generated modules import each other as `lorafleet.v1.X_pb2`; we rewrite those imports to the
package path they live under so no sys.path trick is needed.
"""
from __future__ import annotations

import pathlib
import re
import sys

from grpc_tools import protoc
import grpc_tools

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
OUT = ROOT / "services" / "common" / "gen"
PKG = "services.common.gen"


def main() -> int:
    files = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
    OUT.mkdir(parents=True, exist_ok=True)
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTOS}", f"-I{include}", f"--python_out={OUT}", f"--pyi_out={OUT}",
            f"--grpc_python_out={OUT}", *files]
    if protoc.main(args) != 0:
        print("protoc failed", file=sys.stderr)
        return 1
    for d in [OUT, *[p for p in OUT.rglob("*") if p.is_dir()]]:
        (d / "__init__.py").touch()
    pattern = re.compile(r"^from lorafleet\.v1 import", re.M)
    for f in OUT.rglob("*.py"):
        text = f.read_text()
        new = pattern.sub(f"from {PKG}.lorafleet.v1 import", text)
        if new != text:
            f.write_text(new)
    print(f"generated stubs for {len(files)} protos into {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
