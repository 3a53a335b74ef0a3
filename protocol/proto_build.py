"""Compile `protocol/*.proto` into Python modules on first import, so generated code is built, never committed.

The generated files land in `protocol/_generated/` (git-ignored) and are rebuilt whenever a `.proto` is newer
than its module. grpcio-tools is already a dependency of hivemind, so this adds nothing to install.
"""

from __future__ import annotations

import importlib
import os
import tempfile
from pathlib import Path
from types import ModuleType

PROTO_DIR = Path(__file__).resolve().parent
GENERATED_DIR = PROTO_DIR / "_generated"


def _compile(proto: Path, target: Path) -> None:
    from grpc_tools import protoc  # imported lazily: only needed when the module is stale

    with tempfile.TemporaryDirectory(dir=PROTO_DIR) as tmp:
        status = protoc.main(["protoc", f"-I{PROTO_DIR}", f"--python_out={tmp}", str(proto)])
        if status != 0:
            raise RuntimeError(f"protoc failed ({status}) on {proto}")
        os.replace(Path(tmp) / target.name, target)  # atomic: concurrent importers never see half a file


def load_proto_module(stem: str) -> ModuleType:
    """Import `<stem>_pb2`, compiling `<stem>.proto` first when the generated module is missing or stale."""
    proto = PROTO_DIR / f"{stem}.proto"
    target = GENERATED_DIR / f"{stem}_pb2.py"
    GENERATED_DIR.mkdir(exist_ok=True)
    init = GENERATED_DIR / "__init__.py"
    if not init.exists():  # a read-only install (the Docker image's, run as non-root) has it already
        init.touch()
    if not target.exists() or target.stat().st_mtime < proto.stat().st_mtime:
        _compile(proto, target)
    return importlib.import_module(f"hetero_node.protocol._generated.{stem}_pb2")
