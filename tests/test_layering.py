"""The shape of the package, checked by reading the source.

Imports only point down the layers (LAYERS, as docs/concepts.md draws them), there is
no import cycle anywhere in mpishard/, no module grows past MAX_LINES, and
docs/concepts.md's "where things go" table names files and registries that exist.
"""
import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "mpishard"
MAX_LINES = 600

# The layers, lowest first (docs/concepts.md, "The shape of the code"): a folder may import
# the folders listed before it and none after, except as written in MAY_ALSO.
LAYERS = ["core", "kernels", "autodiff", "nn", "optim", "models", "comm", "parallel",
          "planning", "checkpoint", "data", "recipes", "config", "hf", "bench", "run", "cli"]
# folders on one level that must not know each other
SIDE_BY_SIDE = {"comm": {"nn", "optim", "models"}, "parallel": {"models"},
                "optim": {"models"}, "nn": {"optim"}}
# runtime code never imports the test helpers, except the strict array module that
# the backend can select by name
TESTING_ALLOWED = {"core"}
NOT_BELOW_MODELS = {"mpi4py", "cupy"}


def _forbidden(layer: str) -> set:
    above = LAYERS[LAYERS.index(layer) + 1:]
    banned = {f"mpishard.{name}" for name in above} | {f"mpishard.{name}" for name in
                                                          SIDE_BY_SIDE.get(layer, ())}
    if layer == "core":
        banned.add("mpi4py")      # the backend asks for CuPy lazily, by name
    elif LAYERS.index(layer) <= LAYERS.index("models"):
        banned |= NOT_BELOW_MODELS
    if layer not in TESTING_ALLOWED:
        banned.add("mpishard.testing")
    return banned


# layer -> packages/modules it must never import (directly or by relative import)
FORBIDDEN = {layer: _forbidden(layer) for layer in LAYERS}
# the one kernels module that asks CuPy where its CUDA libraries are (lazily, when a
# product first runs on a device)
CUPY_ALLOWED = {"kernels/cuda/libs.py"}


def module_name(path: Path, root: Path = PKG) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _base(node: ast.ImportFrom, path: Path, root: Path) -> str:
    if node.level == 0:
        return node.module or ""
    parts = module_name(path, root).split(".")
    if path.name != "__init__.py":
        parts = parts[:-1]                     # the package the module is in
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def imports_of(path: Path, top_level_only: bool = False, root: Path = PKG):
    """Every name an import in ``path`` reaches: ``from a import b`` yields ``a`` and ``a.b``."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            base = _base(node, path, root)
            yield base
            for alias in node.names:
                yield f"{base}.{alias.name}"


def import_graph(root: Path = PKG) -> dict:
    """Module -> the package modules it imports (any import, also inside functions).

    ``from . import x`` is an edge to the module ``x``, not to the package it
    is in; ``from .m import name`` an edge to ``m``.
    """
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                base = _base(node, path, root)
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
                edges.update(subs)
                if base in modules and len(subs) < len(node.names):
                    edges.add(base)
        edges.discard(name)
        graph[name] = sorted(edges)
    return graph


def cycles(graph: dict) -> list:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.get(child, []))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_point_down(layer):
    folder = PKG / layer
    bad = []
    for path in sorted(folder.rglob("*.py")):
        if str(path.relative_to(PKG)) in CUPY_ALLOWED:
            continue
        for name in imports_of(path):
            for forbidden in FORBIDDEN[layer]:
                if name == forbidden or name.startswith(forbidden + "."):
                    bad.append(f"{path.relative_to(PKG.parent)} imports {name}")
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def test_no_module_over_the_line_limit():
    long = {str(p.relative_to(PKG.parent)): n for p in sorted(PKG.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split along a real seam): {long}"


def test_no_top_level_cupy_import_anywhere():
    bad = [str(p.relative_to(PKG.parent)) for p in PKG.rglob("*.py")
           if any(n == "cupy" or n.startswith("cupy") for n in imports_of(p, True))]
    assert not bad, f"top-level cupy imports: {bad}"


def test_checker_sees_a_forbidden_import(tmp_path):
    """The import reader itself can fail."""
    fake = tmp_path / "probe.py"
    fake.write_text("import numpy\nfrom mpi4py import MPI\n")
    assert "mpi4py" in list(imports_of(fake))


def test_cycle_checker_finds_a_cycle(tmp_path):
    """A package whose a -> b -> c -> a (the last one lazily, inside a function) is caught,
    as the old comm -> gpu -> mesh -> communicator cycle was; from . import x is not one."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .a import A\n")
    (pkg / "a.py").write_text("from . import b\nA = 1\n")
    (pkg / "b.py").write_text("from .c import C\n")
    (pkg / "c.py").write_text("C = 3\ndef f():\n    from .a import A\n    return A\n")
    (pkg / "d.py").write_text("from . import a\n")
    found = cycles(import_graph(pkg))
    assert found == [["pkg.a", "pkg.b", "pkg.c"]]
    (pkg / "c.py").write_text("C = 3\n")
    assert cycles(import_graph(pkg)) == []


CONCEPTS = PKG.parent / "docs" / "concepts.md"


def _concepts_section() -> str:
    text = CONCEPTS.read_text()
    start = text.index("## The shape of the code")
    return text[start:text.index("\n## ", start + 1)]


def test_the_documented_layers_are_the_checked_ones():
    line = next(l for l in _concepts_section().splitlines() if l.startswith("layers: "))
    assert [name.strip() for name in line[len("layers: "):].split("<")] == LAYERS


def test_every_folder_of_the_package_is_a_documented_layer():
    folders = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders - {"testing"} == set(LAYERS), sorted(folders ^ set(LAYERS))


def _where_things_go() -> dict:
    section = _concepts_section()
    table = section[section.index("### Where things go"):]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("a "):
            rows[cells[0]] = re.findall(r"`(mpishard/[^`]+)`", cells[1])
    return rows


def _expand(path: str) -> list:
    """A documented path with ``<family>`` / ``<axis>`` as the real paths it stands for."""
    if "<family>" in path:
        families = sorted(p.name for p in (PKG / "models").iterdir()
                          if p.is_dir() and (p / "spec.py").exists())
        return [path.replace("<family>", f) for f in families]
    if "<axis>" in path:
        axes = sorted(p.name for p in (PKG / "parallel").iterdir()
                      if p.is_dir() and (p / "__init__.py").exists())
        return [path.replace("<axis>", a) for a in axes]
    return [path]


def test_where_things_go_matches_the_code():
    rows = _where_things_go()
    assert set(rows) == {"a model family", "a strategy", "a kernel", "a collective backend"}
    root = PKG.parent
    for what, paths in rows.items():
        assert paths, what
        for documented in paths:
            model_module = documented.endswith("<family>/model.py")
            for path in _expand(documented):
                if model_module:          # a family may take another family's module
                    continue
                assert (root / path).exists(), f"docs/concepts.md ({what}) names {path}"
    # the registries hold one line per thing
    from mpishard.comm.backends import BACKENDS
    from mpishard.kernels.protocol import KernelSet
    from mpishard.models.registry import MODELS
    from mpishard.parallel import STRATEGIES
    families = [p.parent.name for p in (PKG / "models").glob("*/spec.py")]
    assert families and all(f in MODELS for f in families), (families, sorted(MODELS))
    registering = [p for p in (PKG / "parallel").glob("*/*.py")
                   if "@register_strategy(" in p.read_text()]
    shipped = {e.cls.__module__ for e in STRATEGIES.values()
               if e.cls.__module__.startswith("mpishard.")}  # tests register their own too
    assert shipped == {module_name(p) for p in registering}
    assert {p.stem for p in (PKG / "comm" / "backends").glob("*.py")} - {
        "__init__", "base", "one_rank"} <= set(BACKENDS)
    assert [n for n in dir(KernelSet) if not n.startswith("_")]


def test_the_tests_mirror_the_package():
    """A test lives in the folder of the package folder it tests (project-wide checks, such
    as this file, at the top); tests/ckpt_scripts and tests/mpi_scripts are helpers."""
    tests = PKG.parent / "tests"
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders - {"ckpt_scripts", "mpi_scripts"} <= set(LAYERS) | {"testing"}, folders
    assert not {p.name for p in tests.glob("*/test_*.py")} & {p.name for p in tests.glob("test_*.py")}
