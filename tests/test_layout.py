"""The package's shape, checked from its source (issue 34): no module reaches
for another module's private names, and the module-level imports between
qgemv's modules form no circle."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# installed name -> folder in the checkout (setup.py's package_dir)
PACKAGES = {"qgemv": ROOT / "qgemv", "qgemv.calibration": ROOT / "calibration", "qgemv.eval": ROOT / "eval"}


@functools.lru_cache(maxsize=None)
def _modules() -> dict:
    """{dotted module name: path} of every .py file of the installed packages."""
    out = {}
    for pkg, folder in PACKAGES.items():
        for f in sorted(folder.glob("*.py")):
            out[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = f
    return out


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names (relative imports resolved against ``module``)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base if is_pkg else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, path: Path, top_level_only: bool) -> list:
    """[(imported module, [names], line)] of one file: ``from X import a, b`` gives (X, [a, b]);
    ``from . import sub`` gives (pkg.sub, []).  Names of our own modules only."""
    mods = _modules()
    tree = ast.parse(path.read_text(), str(path))
    body = tree.body if top_level_only else ast.walk(tree)
    out = []
    for node in body:
        if isinstance(node, ast.ImportFrom):
            src = _resolve(module, path.stem == "__init__", node)
            names = []
            for a in node.names:
                sub = f"{src}.{a.name}" if src else a.name
                if sub in mods:
                    out.append((sub, [], node.lineno))
                else:
                    names.append(a.name)
            if src in mods and names:
                out.append((src, names, node.lineno))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in mods:
                    out.append((a.name, [], node.lineno))
    return out


def test_no_private_names_cross_modules():
    """``from .x import _name`` and ``x._name`` (x another of our modules) appear nowhere."""
    mods = _modules()
    bad = []
    for module, path in mods.items():
        for src, names, line in _imports(module, path, top_level_only=False):
            bad += [f"{path.relative_to(ROOT)}:{line} imports {src}.{n}" for n in names
                    if n.startswith("_") and not n.startswith("__") and n != "_C"]  # _C: the compiled extension
        # attribute access through an imported module: checkpoint._x
        tree = ast.parse(path.read_text(), str(path))
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                src = _resolve(module, path.stem == "__init__", node)
                for a in node.names:
                    sub = f"{src}.{a.name}" if src else a.name
                    if sub in mods and sub != module:
                        aliases[a.asname or a.name] = sub
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    # the deprecated aliases (qgemv.stream, calibration.stream) import their new module privately by design
    bad = [b for b in bad if not b.split(":")[0].endswith("stream.py")]
    assert not bad, "private names used across modules:\n" + "\n".join(bad)


def test_no_import_circle():
    """Module-level imports between our modules (the package __init__ files aside) form no cycle."""
    mods = _modules()
    graph = {m: set() for m in mods if not mods[m].stem == "__init__"}
    for m in graph:
        for src, _names, _line in _imports(m, mods[m], top_level_only=True):
            if src in graph and src != m:
                graph[m].add(src)
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_checkpoint_split_keeps_public_names():
    """The names qgemv.checkpoint had before the split still import from it (one object each)."""
    from qgemv import checkpoint, float_model, outdir, safetensors_io

    for name, home in [("load_float_model", float_model), ("default_model_path", float_model),
                       ("resolve_model", float_model), ("check_output_dir", outdir), ("is_disk_full", outdir),
                       ("checkpoint_files", safetensors_io), ("read_checkpoint_tensors", safetensors_io),
                       ("save_tensors", safetensors_io)]:
        assert getattr(checkpoint, name) is getattr(home, name), name
    for name in checkpoint.__all__:
        assert hasattr(checkpoint, name), name
