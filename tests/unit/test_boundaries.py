"""Package boundaries (DESIGN §1): the engine knows nothing of nodes, proxy or transports, the proxy's share of it
(types, hashing, detokenizer, output processor, config, tokenizer, GGUF metadata) imports no torch, and `wire`
(what goes over the wire) is standard library only."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN_FOR_ENGINE = {"proxy", "prefill_node", "decode_node", "kvtransfer", "protos", "cluster"}


def imported_top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_engine_imports_no_node_proxy_or_transport_package() -> None:
    offenders = {str(p.relative_to(ROOT)): imported_top_level_names(p) & FORBIDDEN_FOR_ENGINE
                 for p in (ROOT / "engine").rglob("*.py")}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_torch_free_modules_do_not_import_torch() -> None:
    code = ("import sys, engine, engine.types, engine.hashing, engine.detokenizer, engine.output_processor, "
            "engine.config, engine.tokenizer, engine.gguf_config; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_wire_imports_only_the_standard_library_and_itself() -> None:
    allowed = set(sys.stdlib_module_names) | {"wire"}
    offenders = {str(p.relative_to(ROOT)): imported_top_level_names(p) - allowed for p in (ROOT / "wire").rglob("*.py")}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_importing_wire_loads_no_torch_redis_grpc_or_protobuf() -> None:
    code = ("import sys, wire, wire.nodes, wire.registry, wire.ticket, wire.errors; "
            "loaded = {'torch', 'redis', 'grpc', 'google', 'engine', 'kvtransfer'} "
            "& {m.split('.')[0] for m in sys.modules}; "
            "assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
