"""extproc.core is sans-IO: it imports only the standard library and itself.

Checked statically with `ast`: `'grpc' not in sys.modules` would prove nothing, since other
tests in the same process import grpc.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "extproc" / "core"
MODULES = sorted(CORE.glob("*.py"))

# IO, frameworks and parsers that belong in the adapters, never in the core.
FORBIDDEN = ("grpc", "aetcd", "etcd3", "google", "google.protobuf", "opentelemetry", "socket",
             "asyncio", "subprocess", "aiohttp", "httpx", "yaml", "requests", "threading",
             "selectors", "ssl", "urllib.request", "http.client", "multiprocessing")


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(level, absolute-or-relative module name) for every import in the module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(0, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.level, node.module or ""))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name | ast.Attribute):
            name = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
            # Dynamic imports would dodge this check: forbid them outright.
            assert name not in ("__import__", "import_module"), f"{path.name}: dynamic import"
    return found


def test_the_core_modules_are_found() -> None:
    names = {p.stem for p in MODULES}
    assert {"machine", "sse", "config", "intake", "journal", "errors"} <= names


def _forbidden(module: str) -> bool:
    return any(module == f or module.startswith(f + ".") for f in FORBIDDEN)


@pytest.mark.parametrize("path", MODULES, ids=[p.name for p in MODULES])
def test_core_module_imports_only_stdlib_and_core(path: Path) -> None:
    for level, module in imports_of(path):
        if level == 1:
            # `from . import x` / `from .sse import y`: a sibling in extproc.core.
            sibling = module.split(".")[0]
            assert not module or (CORE / f"{sibling}.py").exists(), (path.name, module)
            continue
        assert level == 0, f"{path.name}: relative import escapes extproc.core ({module})"
        assert not _forbidden(module), f"{path.name} imports {module}"
        top = module.split(".")[0]
        if top == "extproc":
            assert module == "extproc.core" or module.startswith("extproc.core."), (
                f"{path.name} imports {module}")
            continue
        assert top in sys.stdlib_module_names, f"{path.name} imports non-stdlib {module}"


def test_the_checker_itself_catches_violations(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    for src in ("import grpc\n", "from google.protobuf import struct_pb2\n",
                "import asyncio\n", "from ..adapters import server\n", "import yaml\n",
                "from opentelemetry import trace\n", "import socket as s\n"):
        bad.write_text(src)
        with pytest.raises(AssertionError):
            test_core_module_imports_only_stdlib_and_core(bad)
    bad.write_text("import json\nfrom collections.abc import Mapping\n")
    test_core_module_imports_only_stdlib_and_core(bad)
