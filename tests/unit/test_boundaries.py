"""Package boundaries (docs/architecture.md#layering): the engine knows nothing of nodes, proxy or transports, the
proxy's share of it (types, hashing, detokenizer, output processor, config, tokenizer, GGUF metadata) imports no torch,
and `wire` (what goes over the wire) is standard library only."""

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


def imported_modules(path: Path) -> set[str]:
    """Every absolute module a file imports, at any depth (function-level imports too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_proxy_routing_layer_never_imports_the_api_layer() -> None:
    """proxy/ is two layers: api (HTTP, OpenAI shapes, output processing) above routing (directory, router,
    the P/D attempt). Routing knows nothing of HTTP, so an import upwards would be a circle in the making."""
    offenders = {str(p.relative_to(ROOT)): {m for m in imported_modules(p) if m.startswith("proxy.api")}
                 for p in (ROOT / "proxy" / "routing").rglob("*.py")}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_proxy_modules_live_in_a_layer() -> None:
    top_level = sorted(p.name for p in (ROOT / "proxy").glob("*.py"))
    assert top_level == ["__init__.py", "__main__.py"]
