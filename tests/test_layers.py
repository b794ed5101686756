"""The import graph: the layers of ``docs/design.md``, no cycles, no private doors.

Every ``import`` and ``from ... import`` in ``blobpipe`` (at module level and inside
functions, type-only ones included) is read with ``ast``:

* each goes to a layer that the importing module's layer may import (the table at the
  top of ``docs/design.md``, read here: the DAG is written once), or to its own layer;
* no module imports itself back through others;
* a module uses no other module's private members: ``x._name`` where ``x`` is not
  ``self``/``cls`` and ``_name`` is defined in another module of ``blobpipe``, and
  ``from mod import _private`` across packages.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "blobpipe"
DESIGN = ROOT / "docs" / "design.md"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
TREES = {m: ast.parse(p.read_text(encoding="utf-8"), str(p)) for m, p in MODULES.items()}


def _package_of(module: str) -> str:
    return module if MODULES[module].name == "__init__.py" else module.rsplit(".", 1)[0]


def imports(module: str) -> list[tuple[str, list[str], int]]:
    """``(target module, imported names, line)`` for every import of ``module`` that
    goes to ``blobpipe``; ``from pkg import mod`` of a submodule targets the submodule."""
    out = []
    package = _package_of(module).split(".")
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "blobpipe":
                continue
            plain = [a.name for a in node.names if f"{target}.{a.name}" not in MODULES]
            if plain:
                out.append((target, plain, node.lineno))
            for a in node.names:
                if f"{target}.{a.name}" in MODULES:
                    out.append((f"{target}.{a.name}", [], node.lineno))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "blobpipe":
                    out.append((a.name, [], node.lineno))
    return out


def layers() -> tuple[dict[str, str], dict[str, set[str]]]:
    """From design.md's table: each module prefix's layer, and what each layer may import."""
    text = DESIGN.read_text(encoding="utf-8")
    section = text[text.index("## Layers") :]
    section = section[: section.index("\n## ", 1)]
    owner: dict[str, str] = {}
    allowed: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or cells[0] in ("layer", "---"):
            continue
        layer, modules, _, may = cells
        for name in re.findall(r"`([^`]+)`", modules):
            owner["blobpipe" if name == "blobpipe" else f"blobpipe.{name}"] = layer
        allowed[layer] = {m.strip() for m in may.split(",") if m.strip()}
    return owner, allowed


def layer_of(module: str, owner: dict[str, str]) -> str:
    best = max(
        (p for p in owner if module == p or module.startswith(p + ".")), key=len, default=None
    )
    assert best is not None, f"{module} is in no layer of docs/design.md's table: add it there"
    return owner[best]


def test_the_layer_table_names_every_module_and_only_known_layers() -> None:
    owner, allowed = layers()
    assert len(allowed) >= 10, "docs/design.md's layer table was not found"
    for module in MODULES:
        layer_of(module, owner)
    for layer, may in allowed.items():
        unknown = may - set(allowed)
        assert not unknown, f"layer {layer!r} may import unknown layers {unknown}"


def test_every_import_follows_the_layers() -> None:
    owner, allowed = layers()
    wrong = []
    for module in MODULES:
        mine = layer_of(module, owner)
        for target, _, line in imports(module):
            theirs = layer_of(target, owner)
            if theirs != mine and theirs not in allowed[mine]:
                wrong.append(f"{module}:{line} ({mine}) imports {target} ({theirs})")
    assert not wrong, "imports against docs/design.md's layers:\n" + "\n".join(wrong)


def test_the_layers_are_a_dag() -> None:
    _, allowed = layers()
    state: dict[str, int] = {}

    def visit(layer: str, path: list[str]) -> None:
        if state.get(layer) == 2:
            return
        assert state.get(layer) != 1, f"the layers form a cycle: {' → '.join([*path, layer])}"
        state[layer] = 1
        for other in allowed[layer]:
            visit(other, [*path, layer])
        state[layer] = 2

    for layer in allowed:
        visit(layer, [])


def test_no_module_imports_itself_back() -> None:
    graph = {m: sorted({t for t, _, _ in imports(m) if t in MODULES and t != m}) for m in MODULES}
    state: dict[str, int] = {}
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        if state.get(module) == 2:
            return
        if state.get(module) == 1:
            cycles.append(" → ".join([*path[path.index(module) :], module]))
            return
        state[module] = 1
        for other in graph[module]:
            visit(other, [*path, module])
        state[module] = 2

    for module in graph:
        visit(module, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_checks_see_function_level_and_type_only_imports() -> None:
    """The walk is not fooled by an import inside a function or under TYPE_CHECKING."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ._blob import Blob\n"
        "def f():\n    from ._loader import Loader\n"
    )
    TREES["blobpipe._codec"], saved = ast.parse(source), TREES["blobpipe._codec"]
    try:
        targets = {t for t, _, _ in imports("blobpipe._codec")}
    finally:
        TREES["blobpipe._codec"] = saved
    assert targets == {"blobpipe._blob", "blobpipe._loader"}


# -- private members across modules ------------------------------------------------------------


def _defined_private(module: str) -> set[str]:
    """The private names ``module`` defines: top-level, in classes, and ``self._x =``."""
    names: set[str] = set()
    for node in ast.walk(TREES[module]):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def private_uses() -> Counter[tuple[str, str]]:
    """``(module, "x._name" or "from mod import _name")`` per use, counted."""
    own = {m: _defined_private(m) for m in MODULES}
    uses: Counter[tuple[str, str]] = Counter()
    for module, tree in TREES.items():
        elsewhere = set().union(*(own[m] for m in MODULES if m != module)) - own[module]
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
                if node.attr.startswith("__") or node.attr not in elsewhere:
                    continue
                base = node.value
                if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                    continue
                text = ast.unparse(base)
                uses[(module, f"{text}.{node.attr}")] += 1
        for target, names, _ in imports(module):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and _package_of(target) != _package_of(module):
                for n in private:
                    uses[(module, f"from {target} import {n}")] += 1
    return uses


def test_no_private_use_across_modules() -> None:
    """No module uses another module's private members, nor imports a private name
    from another package: what one module needs of another is a named,
    documented method or function of it."""
    uses = private_uses()
    assert not uses, "private members used across modules:\n" + "\n".join(
        f"{m}: {u} ({n}x)" for (m, u), n in sorted(uses.items())
    )


# -- one owner per third party -----------------------------------------------------------------


def test_opencv_is_imported_by_the_image_module_alone() -> None:
    """``_io/_image.py`` owns OpenCV (decode, encode, resize, captions): the pixel limit
    and the error wrapping hold for every image blobpipe reads or writes."""
    importers = sorted(
        module
        for module, tree in TREES.items()
        for node in ast.walk(tree)
        if (isinstance(node, ast.Import) and any(a.name == "cv2" for a in node.names))
        or (isinstance(node, ast.ImportFrom) and node.module == "cv2")
    )
    assert importers == ["blobpipe._io._image"]
