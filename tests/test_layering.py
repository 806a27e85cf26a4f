"""Imports only point down the layers of DESIGN.md (checked by reading the source)."""
import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "mpishard"

# layer -> packages/modules it must never import (directly or by relative import)
FORBIDDEN = {
    "autodiff": {"mpi4py", "mpishard.nn", "mpishard.optim", "mpishard.models", "mpishard.comm",
                 "mpishard.parallel", "mpishard.checkpoint", "mpishard.cli", "mpishard.train",
                 "cupy"},
    "nn": {"mpi4py", "mpishard.comm", "mpishard.parallel", "mpishard.checkpoint",
           "mpishard.optim", "mpishard.models", "mpishard.cli", "mpishard.train", "cupy"},
    "optim": {"mpi4py", "mpishard.comm", "mpishard.parallel", "mpishard.checkpoint",
              "mpishard.models", "mpishard.cli", "mpishard.train", "cupy"},
    "models": {"mpi4py", "mpishard.comm", "mpishard.parallel", "mpishard.checkpoint",
               "mpishard.cli", "mpishard.train", "cupy"},
    "comm": {"mpishard.nn", "mpishard.optim", "mpishard.models", "mpishard.parallel",
             "mpishard.checkpoint", "mpishard.cli", "mpishard.train"},
    "parallel": {"mpishard.checkpoint", "mpishard.cli", "mpishard.train"},
    "checkpoint": {"mpishard.cli", "mpishard.train"},
}


def _absolute(module: str, level: int, path: Path) -> str:
    if level == 0:
        return module
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    base = parts[:-level]
    return ".".join(base + ([module] if module else []))


def imports_of(path: Path, top_level_only: bool = False):
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module or "", node.level, path)
            yield base
            for alias in node.names:
                yield f"{base}.{alias.name}"


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_point_down(layer):
    folder = PKG / layer
    if not folder.exists():
        pytest.skip(f"{layer} not built yet")
    bad = []
    for path in sorted(folder.rglob("*.py")):
        for name in imports_of(path):
            for forbidden in FORBIDDEN[layer]:
                if name == forbidden or name.startswith(forbidden + "."):
                    bad.append(f"{path.relative_to(PKG.parent)} imports {name}")
    assert not bad, "\n".join(bad)


def test_no_top_level_cupy_import_anywhere():
    bad = [str(p.relative_to(PKG.parent)) for p in PKG.rglob("*.py")
           if any(n == "cupy" or n.startswith("cupy") for n in imports_of(p, True))]
    assert not bad, f"top-level cupy imports: {bad}"


def test_checker_sees_a_forbidden_import(tmp_path):
    """The checker itself can fail."""
    fake = tmp_path / "probe.py"
    fake.write_text("import numpy\nfrom mpi4py import MPI\n")
    assert "mpi4py" in list(imports_of(fake))
