"""The house rules of the code's layers, read from the imports (no code is run).

Floors, from the ground up (docs/TESTING.md, "Layering"):

1. the op core: the modules directly in `detlogp_jax/` and `detlogp_jax/body/` (contract,
   numerics, oracle, api, grad, pipeline, the reference backend, the registries, input
   validation, the body ops). It imports no other top-level package of the repository and
   nothing of the floors above it, at module level or inside a function;
2. the backends and tensor parallelism: `pallas_kernels`, `sharding`; they build on the core
   and register with it, and import nothing above it;
3. the integrations (`detlogp_jax.integrations`: Flax, Tunix): they import no application;
4. the applications (`detlogp_jax.apps`: the parity job, the golden tool, the toy LM); the
   core's `validate.py` / `golden.py` / `flax.py` are entry points of one import each;
5. `benchmarks` (and its `experiments`): nothing in the library imports it.

And across packages: no module imports another top-level package's leading-underscore name
(or reads one off an imported module of another package); no import loop between modules.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("detlogp_jax", "pallas_kernels", "sharding", "benchmarks")
ENTRY_POINTS = {"detlogp_jax/validate.py", "detlogp_jax/golden.py", "detlogp_jax/flax.py"}


def _module(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


FILES = {p: _module(p) for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}
MODULES = {m: p for p, m in FILES.items()}


def _imports(path: pathlib.Path, here: str | None = None, source: str | None = None):
    """(syntax tree, [(imported module, imported name or None, line)]) of a file (module name
    `here`, default its own), relative imports resolved."""
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    here = FILES[path] if here is None else here
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            out += [(base, a.name, node.lineno) for a in node.names]
    return tree, out


def _targets(base: str, name: str | None) -> list[str]:
    """The repository modules an import statement loads (a `from pkg import sub` loads pkg.sub)."""
    found = [base] if base in MODULES else []
    if name and f"{base}.{name}" in MODULES:
        found.append(f"{base}.{name}")
    return found


def _floor(module: str) -> int:
    if module.startswith("benchmarks"):
        return 5
    if module.startswith("detlogp_jax.apps"):
        return 4
    if module.startswith("detlogp_jax.integrations"):
        return 3
    if module.startswith(("pallas_kernels", "sharding")):
        return 2
    return 1


GRAPH = {}
EDGES = []  # (file, line, importer, imported)
for _path, _mod in FILES.items():
    _, _imps = _imports(_path)
    GRAPH[_mod] = set()
    for _base, _name, _line in _imps:
        for _t in _targets(_base, _name):
            if _t != _mod:
                GRAPH[_mod].add(_t)
                EDGES.append((_path.relative_to(ROOT).as_posix(), _line, _mod, _t))


def test_every_product_file_is_read():
    assert len(FILES) > 50 and "detlogp_jax.pipeline" in MODULES and "pallas_kernels.body" in MODULES


def _upward(edges):
    """The imports that run up a floor (entry points excepted: one import each)."""
    return [
        f"{f}:{line}: {a} (floor {_floor(a)}) imports {b} (floor {_floor(b)})"
        for f, line, a, b in edges
        if _floor(b) > _floor(a) and f not in ENTRY_POINTS
    ]


def _core_outward(edges):
    """The core's imports of another top-level package."""
    return [
        f"{f}:{line}: {a} imports {b}"
        for f, line, a, b in edges
        if _floor(a) == 1 and b.split(".")[0] != "detlogp_jax" and f not in ENTRY_POINTS
    ]


def test_no_import_runs_up_a_floor():
    bad = _upward(EDGES)
    assert not bad, "\n".join(bad)


def test_the_op_core_imports_no_other_package():
    """The core (floor 1) reaches backends and tensor parallelism only by name (plugins,
    registries), never by an import statement, at module level or inside a function."""
    bad = _core_outward(EDGES)
    assert not bad, "\n".join(bad)


def test_entry_points_are_thin():
    """`detlogp_jax/validate.py`, `golden.py`, `flax.py` (short names users type) import the
    application or integration they name and define nothing of their own."""
    for rel in sorted(ENTRY_POINTS):
        tree, imps = _imports(ROOT / rel)
        targets = {t for b, n, _ in imps for t in _targets(b, n)}
        assert targets and all(t.startswith(("detlogp_jax.apps", "detlogp_jax.integrations")) for t in targets), rel
        defined = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))]
        assert not defined, (rel, [n.name for n in defined])


def test_no_private_name_crosses_a_package():
    """No `from other_pkg... import _name`, and no `other_module._name` read off a module of
    another top-level package (experiments excepted: they probe internals on purpose)."""
    bad = []
    for path, mod in FILES.items():
        if "experiments" in path.parts:
            continue
        top = mod.split(".")[0]
        tree, imps = _imports(path)
        aliases = {}
        for base, name, line in imps:
            other = base.split(".")[0] in PACKAGES and base.split(".")[0] != top
            if other and name and name.startswith("_") and not name.startswith("__"):
                bad.append(f"{path.relative_to(ROOT)}:{line}: from {base} import {name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] in PACKAGES and a.name.split(".")[0] != top:
                        aliases[a.asname or a.name.split(".")[0]] = a.name
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                if node.module.split(".")[0] in PACKAGES and node.module.split(".")[0] != top:
                    for a in node.names:
                        if f"{node.module}.{a.name}" in MODULES:
                            aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                if node.attr.startswith("_") and not node.attr.startswith("__"):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not bad, "\n".join(bad)


def test_no_import_loop():
    index, low, on, stack, loops = {}, {}, set(), [], []
    counter = [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(GRAPH.get(v, ())):
            if MODULES[w].name == "__init__.py":  # a package's namespace, not a module's code
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                loops.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not loops, loops


@pytest.mark.parametrize(
    "source,rule",
    [
        ("import pallas_kernels.wrapper\n", _core_outward),
        ("def f():\n    from sharding import tp\n", _core_outward),
        ("from detlogp_jax.apps import parity\n", _upward),
    ],
)
def test_the_rules_catch_a_bad_import(source, rule):
    """The negative control: a core module importing a backend (at module level or inside a
    function) or an application is reported."""
    probe = ROOT / "detlogp_jax" / "probe.py"
    _, imps = _imports(probe, "detlogp_jax.probe", source)
    edges = [("detlogp_jax/probe.py", line, "detlogp_jax.probe", t) for b, n, line in imps for t in _targets(b, n)]
    assert rule(edges), source
