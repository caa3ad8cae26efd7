"""What the compiled modules (proxy/native MODULES) must not do, checked on their source.

mypyc compiles these modules with the types mypy inferred, and enforces them at run time. Two patterns
type-check cleanly yet behave differently compiled; each one broke a request path before it was found
(the others fail `python -m proxy.native build`, or mypy with `warn_unreachable`):

- one name bound by several `except ... as name` clauses of one function: mypyc gives the variable the
  first clause's type, and a later clause's exception raised TypeError inside the handler (a policy's
  ValueError became "UnknownModel object expected" instead of the proxy's 500);
- a class of an interpreted module that subclasses a compiled class: "interpreted classes cannot inherit
  from compiled" at import (a test's policy did).
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

from proxy.native.loader import MODULES, module_name

REPO = Path(__file__).resolve().parents[2]
PROXY = REPO / "proxy"


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def test_no_function_of_a_compiled_module_reuses_an_except_name_for_another_type() -> None:
    bad = []
    for rel in MODULES:
        for fn in ast.walk(_tree(PROXY / rel)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            types: dict[str, set[str]] = {}
            for node in ast.walk(fn):
                if isinstance(node, ast.ExceptHandler) and node.name:
                    types.setdefault(node.name, set()).add(ast.unparse(node.type) if node.type else "BaseException")
            bad += [f"proxy/{rel}:{fn.lineno} {fn.name}: `as {name}` for {sorted(t)}"
                    for name, t in types.items() if len(t) > 1]
    assert not bad, "give each except clause's variable its own name:\n  " + "\n  ".join(bad)


def test_no_interpreted_class_subclasses_a_compiled_one() -> None:
    compiled = {module_name(rel) for rel in MODULES}
    classes: set[tuple[str, str]] = set()
    for rel in MODULES:
        for node in _tree(PROXY / rel).body:
            if isinstance(node, ast.ClassDef):
                classes.add((module_name(rel), node.name))
    bad = []
    for top in ("proxy", "sim", "loadtest", "tests"):
        for dirpath, dirnames, files in os.walk(REPO / top):
            dirnames[:] = [d for d in dirnames if d not in ("__pycache__", "compiled")]
            for f in files:
                if not f.endswith(".py"):
                    continue
                path = Path(dirpath) / f
                module = ".".join(path.relative_to(REPO).with_suffix("").parts)
                if module in compiled:
                    continue
                tree = _tree(path)
                imported = {a.asname or a.name: n.module for n in ast.walk(tree)
                            if isinstance(n, ast.ImportFrom) and n.module for a in n.names}
                for node in ast.walk(tree):
                    if isinstance(node, ast.ClassDef):
                        for base in node.bases:
                            if isinstance(base, ast.Name) and (imported.get(base.id), base.id) in classes:
                                bad.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}({base.id})")
    assert not bad, "wrap the compiled class instead of subclassing it:\n  " + "\n  ".join(bad)
