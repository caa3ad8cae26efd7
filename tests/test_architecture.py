"""The package's shape, checked from its source: no import cycles among proxy modules, a pure routing core,
and no unexplained `# type: ignore`.

The import graph is read with `ast`, never by importing anything, so it sees what a runtime check would
miss: imports under `if TYPE_CHECKING:` (a cycle there is still a cycle in the design, and turns into a
runtime one the day somebody needs the name at run time), imports inside functions (deferred imports are
the usual way a cycle gets hidden), and relative imports. Every check is run once against a small package
built in `tmp_path`, so none of them can pass by finding nothing.
"""

from __future__ import annotations

import ast
import io
import re
import textwrap
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROXY = REPO / "proxy"

# The routing core is plain data in, decisions out: no event loop, no transport, no sockets, no logging and
# no clock (time is passed in by the caller, so every decision can be replayed).
CORE_FORBIDDEN = ("aiohttp", "h2", "asyncio", "socket", "ssl", "logging", "time")


@dataclass(frozen=True)
class Edge:
    """`source` imports `target` at `path:line`."""

    source: str
    target: str
    path: Path
    line: int

    def where(self, root: Path) -> str:
        return f"{self.path.relative_to(root.parent)}:{self.line}"


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the package directory `root` (packages by their
    `__init__.py`)."""
    names: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _resolve_from(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` names (relative imports resolved against `module`)."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if _is_package(path) else module.split(".")[:-1]
    if node.level - 1 > len(package):
        raise ValueError(f"{path}:{node.lineno}: relative import goes above the top-level package")
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _known_target(name: str, modules: dict[str, Path]) -> str | None:
    """The most specific module of the package that importing `name` loads, or None if it is outside."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _is_main_guard(node: ast.AST) -> bool:
    """`if __name__ == "__main__":`"""
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    test = node.test
    sides = [test.left, *test.comparators]
    return (len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)
            and any(isinstance(x, ast.Name) and x.id == "__name__" for x in sides)
            and any(isinstance(x, ast.Constant) and x.value == "__main__" for x in sides))


def _walk_outside_main_guard(tree: ast.AST) -> list[ast.AST]:
    """ast.walk, minus the body of `if __name__ == "__main__":` at module level: that code runs only when
    the file is a script, where it is not part of the package's import graph (a module there may even
    import itself by name, on purpose, to use the package's copy of its classes). Its `else:` still runs
    on import and is walked."""
    nodes: list[ast.AST] = []
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        nodes.append(node)
        if isinstance(node, ast.Module):
            for child in node.body:
                if _is_main_guard(child):
                    assert isinstance(child, ast.If)
                    pending.extend(child.orelse)
                else:
                    pending.append(child)
        else:
            pending.extend(ast.iter_child_nodes(node))
    return nodes


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """Every module `module` loads with an import statement anywhere in its file (top level, functions,
    `if TYPE_CHECKING:`, try/except), as (absolute dotted name, line). Names of the package are resolved to
    the most specific module of `modules` they load (`from pkg import name` is `pkg.name` when that is a
    module, `pkg` otherwise); other names are kept as written (`from time import monotonic` is `time`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[tuple[str, int]] = []
    for node in _walk_outside_main_guard(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append((_known_target(alias.name, modules) or alias.name, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(module, path, node)
            submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
            if submodules:
                found.extend((name, node.lineno) for name in submodules)
            else:
                found.append((_known_target(base, modules) or base, node.lineno))
    return found


@dataclass(repr=False)
class ImportGraph:
    root: Path
    modules: dict[str, Path]
    internal: dict[str, list[Edge]]  # module -> its imports of modules of the package
    external: dict[str, list[Edge]]  # module -> its imports of anything else (target: the name as written)

    def __repr__(self) -> str:  # short, for pytest's tracebacks
        return f"ImportGraph({self.root}, {len(self.modules)} modules)"

    @classmethod
    def build(cls, root: Path) -> ImportGraph:
        modules = module_names(root)
        internal: dict[str, list[Edge]] = {m: [] for m in modules}
        external: dict[str, list[Edge]] = {m: [] for m in modules}
        for module, path in modules.items():
            seen: set[tuple[str, bool]] = set()
            for name, line in imports_of(module, path, modules):
                inside = name in modules
                if (name, inside) in seen:
                    continue
                seen.add((name, inside))
                if not inside:
                    external[module].append(Edge(module, name, path, line))
                elif name != module or not _is_package(path):
                    # `from . import x` in pkg/__init__.py, x not a submodule, names pkg itself: not a loop.
                    internal[module].append(Edge(module, name, path, line))
        return cls(root, modules, internal, external)

    def tangles(self) -> list[tuple[list[str], list[list[Edge]]]]:
        """Every strongly connected set of modules (a "tangle": each reaches every other through imports),
        sorted, with a shortest cycle through each of its modules (rotations of one cycle given once)."""
        found = []
        for component in _strongly_connected(self.internal):
            cycles: list[list[Edge]] = []
            seen: set[frozenset[tuple[str, str]]] = set()
            for start in sorted(component):
                cycle = self._shortest_cycle(start, component)
                key = frozenset((e.source, e.target) for e in cycle or [])
                if cycle and key not in seen:
                    seen.add(key)
                    cycles.append(cycle)
            found.append((sorted(component), cycles))
        return sorted(found)

    def cycles(self) -> list[list[Edge]]:
        return [cycle for _, cycles in self.tangles() for cycle in cycles]

    def _shortest_cycle(self, start: str, component: set[str]) -> list[Edge] | None:
        # BFS from `start` inside the component back to `start`.
        previous: dict[str, Edge] = {}
        frontier = [start]
        visited = {start}
        while frontier:
            following = []
            for node in frontier:
                for edge in self.internal[node]:
                    if edge.target not in component:
                        continue
                    if edge.target == start:
                        path = [edge]
                        while path[0].source != start:
                            path.insert(0, previous[path[0].source])
                        return path
                    if edge.target not in visited:
                        visited.add(edge.target)
                        previous[edge.target] = edge
                        following.append(edge.target)
            frontier = following
        return None

    def forbidden_imports(self, package: str, forbidden: tuple[str, ...]) -> list[list[Edge]]:
        """For every module in `package` that loads a forbidden module, directly or through modules of the
        package outside `package`, the chain of imports that does it (the last edge is the forbidden one)."""
        def banned(name: str) -> bool:
            return any(name == f or name.startswith(f + ".") for f in forbidden)

        chains = []
        for module in sorted(self.modules):
            if not (module == package or module.startswith(package + ".")):
                continue
            # BFS through internal modules that are *not* in `package` (those are checked on their own).
            previous: dict[str, Edge] = {}
            frontier = [module]
            visited = {module}
            while frontier:
                following = []
                for node in frontier:
                    for edge in self.external[node]:
                        if banned(edge.target):
                            chain = [edge]
                            while chain[0].source != module:
                                chain.insert(0, previous[chain[0].source])
                            chains.append(chain)
                    for edge in self.internal[node]:
                        inside = edge.target == package or edge.target.startswith(package + ".")
                        if not inside and edge.target not in visited:
                            visited.add(edge.target)
                            previous[edge.target] = edge
                            following.append(edge.target)
                frontier = following
        return chains


def _strongly_connected(graph: dict[str, list[Edge]]) -> list[set[str]]:
    """Tarjan's algorithm (iterative); only components that contain a cycle (size > 1, or a self-loop)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    result: list[set[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            advanced = False
            for edge in edges:
                target = edge.target
                if target not in index:
                    index[target] = low[target] = counter
                    counter += 1
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(graph[target])))
                    advanced = True
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1 or any(e.target == node for e in graph[node]):
                    result.append(component)
    return result


def describe_chain(chain: list[Edge], root: Path) -> str:
    names = " -> ".join([chain[0].source] + [e.target for e in chain])
    where = ", ".join(e.where(root) for e in chain)
    return f"{names}   ({where})"


# `# type: ignore[code]  # why`: the code says which error is silenced, the reason says why that is right.
_IGNORE = re.compile(r"type:\s*ignore")
_IGNORE_WITH_REASON = re.compile(r"type:\s*ignore\[[\w\-, ]+\]\s*#\s*\S")


def unexplained_type_ignores(root: Path) -> list[str]:
    """`file:line: comment` for every `# type: ignore` comment under `root` without an error code and a
    reason after it. Comments are found with `tokenize`, so the phrase inside a string does not count."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT and _IGNORE.search(tok.string) \
                    and not _IGNORE_WITH_REASON.search(tok.string):
                bad.append(f"{path.relative_to(root.parent)}:{tok.start[0]}: {tok.string}")
    return bad


# --- the checks on proxy/ -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def graph() -> ImportGraph:
    return ImportGraph.build(PROXY)


def test_the_graph_sees_the_whole_package(graph: ImportGraph) -> None:
    # Guards against a vacuous pass: the walk found the package's modules and their imports of each other.
    assert "proxy.core.policies" in graph.modules and "proxy.app" in graph.modules
    assert sum(len(edges) for edges in graph.internal.values()) > 100


def describe_tangles(graph: ImportGraph) -> str:
    lines = []
    for members, cycles in graph.tangles():
        lines.append(f"{len(members)} modules import each other in a circle: {', '.join(members)}")
        lines.extend("    " + describe_chain(cycle, graph.root) for cycle in cycles)
    return "\n".join(lines)


def test_no_import_cycles_among_proxy_modules(graph: ImportGraph) -> None:
    assert not graph.tangles(), (
        "import cycles among proxy modules (imports under `if TYPE_CHECKING:` and inside functions count; "
        "each line below is one shortest cycle, with where each of its imports is):\n" + describe_tangles(graph))


def test_the_routing_core_imports_no_io_logging_or_clock(graph: ImportGraph) -> None:
    chains = graph.forbidden_imports("proxy.core", CORE_FORBIDDEN)
    assert not chains, (
        f"proxy/core must stay pure (no {', '.join(CORE_FORBIDDEN)}), but:\n  "
        + "\n  ".join(describe_chain(c, PROXY) for c in chains))


def test_the_product_does_not_reach_into_the_load_tests_or_the_tests(graph: ImportGraph) -> None:
    # The demo runs the simulator, a package of its own (sim/); loadtest/ and tests/ use the proxy, never
    # the other way round.
    chains = graph.forbidden_imports("proxy", ("loadtest", "tests"))
    assert not chains, "proxy/ imports:\n  " + "\n  ".join(describe_chain(c, PROXY) for c in chains)


def test_every_type_ignore_in_proxy_says_why() -> None:
    bad = unexplained_type_ignores(PROXY)
    assert not bad, (
        "every `# type: ignore` needs its error code and a reason beside it, like "
        "`# type: ignore[attr-defined]  # grpclib's Channel.close is untyped`:\n  " + "\n  ".join(bad))


# --- the checks themselves, on a package made for them ----------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")
    return root / "pkg"


def test_self_test_finds_cycles_hidden_in_type_checking_functions_and_relative_imports(tmp_path: Path) -> None:
    root = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": """
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from .b import B
            """,
        "pkg/b.py": """
            def make():
                from pkg import a
                return a
            """,
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "from ..d import thing\n",
        "pkg/d.py": "import pkg.sub.c as c\nthing = 1\n",
        "pkg/self_loop.py": "from . import self_loop\n",
        # the else branch of a main guard runs on import
        "pkg/guarded.py": "if __name__ == '__main__':\n    pass\nelse:\n    from . import guarded\n",
        "pkg/clean.py": "from .sub import c\nimport os\n",
    })
    graph = ImportGraph.build(root)
    cycles = {frozenset(e.source for e in c) for c in graph.cycles()}
    assert cycles == {frozenset({"pkg.a", "pkg.b"}), frozenset({"pkg.sub.c", "pkg.d"}),
                      frozenset({"pkg.self_loop"}), frozenset({"pkg.guarded"})}
    message = "\n".join(describe_chain(c, root) for c in graph.cycles())
    assert "pkg.a -> pkg.b -> pkg.a   (pkg/a.py:4, pkg/b.py:3)" in message


def test_self_test_an_acyclic_package_has_no_cycles(tmp_path: Path) -> None:
    root = _write(tmp_path, {
        "pkg/__init__.py": "from .a import x\n",  # a package importing its own module: not a self-loop
        "pkg/a.py": "x = 1\nimport json\n",
        "pkg/b.py": "from pkg.a import x\nfrom . import a\n",
        # only a script runs this, and then the module it imports is the package's copy, not a cycle
        "pkg/script.py": "x = 1\nif __name__ == '__main__':\n    from pkg.script import x\n",
    })
    assert ImportGraph.build(root).cycles() == []


def test_self_test_finds_forbidden_imports_in_core_direct_and_through_other_modules(tmp_path: Path) -> None:
    root = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/core/__init__.py": "",
        "pkg/core/clock.py": "from time import monotonic\n",
        "pkg/core/deferred.py": "def f():\n    import asyncio.events\n",
        "pkg/core/hidden.py": "from ..helpers import thing\n",
        "pkg/core/ok.py": "import timeit\nimport h2o_not_h2\nfrom . import clock\n",
        "pkg/helpers.py": "import logging\nthing = 1\n",
    })
    chains = ImportGraph.build(root).forbidden_imports("pkg.core", ("asyncio", "h2", "logging", "time"))
    assert sorted(describe_chain(c, root) for c in chains) == [
        "pkg.core.clock -> time   (pkg/core/clock.py:1)",
        "pkg.core.deferred -> asyncio.events   (pkg/core/deferred.py:2)",
        "pkg.core.hidden -> pkg.helpers -> logging   (pkg/core/hidden.py:1, pkg/helpers.py:1)",
    ]


def test_self_test_type_ignore_needs_a_code_and_a_reason(tmp_path: Path) -> None:
    root = _write(tmp_path, {"pkg/m.py": """
        x: int = "a"  # type: ignore
        y: int = "a"  # type: ignore[assignment]
        z: int = "a"  # type: ignore[assignment]  # the test wants a str here
        s = "# type: ignore in a string is not a comment"
        """})
    assert unexplained_type_ignores(root) == [
        "pkg/m.py:2: # type: ignore",
        "pkg/m.py:3: # type: ignore[assignment]",
    ]
