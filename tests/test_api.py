"""The public API as a whole: what ``blobpipe`` exports, and what importing it costs.

The exported names are ``blobpipe.__all__`` when the package defines one, else
its explicit re-exports (``from ._x import Name as Name``). A name removed from
the pinned list below fails the test (the API may only grow); a name added is
fine as long as it is documented and annotated like the rest.
"""

from __future__ import annotations
import __future__

import ast
import inspect
import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

import blobpipe
import blobpipe.testing

ROOT = Path(__file__).resolve().parent.parent
INIT = Path(blobpipe.__file__)

#: Every name ``blobpipe`` exported when this list was written: none may go.
PINNED = (
    "MAX_BLOB_AXES",
    "ArrayBatch",
    "Backend",
    "BackendUnavailableError",
    "Batch",
    "BatchPlan",
    "Batches",
    "BenchResult",
    "Blob",
    "BlobIndexError",
    "BlobpipeError",
    "ConvertResult",
    "DataError",
    "DataLayerConfig",
    "DatabaseInfo",
    "DatabaseNotFoundError",
    "ExportResult",
    "Head",
    "LmdbReader",
    "Loader",
    "LoaderStatistics",
    "MeanResult",
    "MemoryPool",
    "OutputExistsError",
    "ParsedDatum",
    "PoolMemoryError",
    "PoolStatistics",
    "ProtoError",
    "ReadTransaction",
    "RecordNotFoundError",
    "RecordParams",
    "ShapeError",
    "SkippedImage",
    "StateError",
    "SyncedMemory",
    "Transform",
    "UnsupportedOperationError",
    "bench",
    "compute_mean",
    "convert_imageset",
    "datum_view",
    "decode_datum",
    "decode_datum_into",
    "encode_encoded_datum",
    "encode_float_datum",
    "encode_raw_datum",
    "export",
    "get_backend",
    "get_pool",
    "inspect_db",
    "load_mean_file",
    "nchw_offset",
    "nchw_to_nhwc",
    "nhwc_offset",
    "nhwc_to_nchw",
    "parse_datum",
    "read_blobproto",
    "read_caffemodel",
    "read_data_layer",
    "read_list_file",
    "set_default_backend",
    "write_blobproto",
)

#: ``blobpipe.testing``: the emulated device for users' CPU-only CI.
PINNED_TESTING = ("EmulatedArray", "EmulatedBackend", "EmulatedEvent", "EmulatedStream")

#: Imported lazily, on first use of a device or an image decoder, never by ``import blobpipe``.
HEAVY = ("cupy", "cv2", "torch")


def _reexports(path: Path) -> dict[str, str]:
    """``{name: defining module}`` of the module's ``from .m import Name as Name`` lines."""
    tree = ast.parse(path.read_text())
    return {
        alias.name: "." * node.level + (node.module or "")
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module != "__future__"
        for alias in node.names
        if alias.asname == alias.name
    }


REEXPORTS = _reexports(INIT)


def _exported(module: types.ModuleType, reexports: dict[str, str]) -> list[str]:
    names = getattr(module, "__all__", None)
    return list(reexports) if names is None else list(names)


EXPORTED = _exported(blobpipe, REEXPORTS)
EXPORTED_TESTING = list(blobpipe.testing.__all__)
ALL = [(blobpipe, name) for name in EXPORTED] + [
    (blobpipe.testing, name) for name in EXPORTED_TESTING
]


def _id(case: tuple[types.ModuleType, str]) -> str:
    module, name = case
    return f"{module.__name__}.{name}"


def _is_api_object(obj: object) -> bool:
    return inspect.isclass(obj) or inspect.isroutine(obj)


# -- the names -------------------------------------------------------------------------------


def test_no_pinned_name_was_removed() -> None:
    missing = sorted(set(PINNED) - set(EXPORTED))
    assert not missing, f"removed from the public API: {missing}"
    missing = sorted(set(PINNED_TESTING) - set(EXPORTED_TESTING))
    assert not missing, f"removed from blobpipe.testing: {missing}"


def test_names_are_unique_and_exist() -> None:
    assert len(EXPORTED) == len(set(EXPORTED))
    assert len(EXPORTED_TESTING) == len(set(EXPORTED_TESTING))
    for module, name in ALL:
        assert hasattr(module, name), f"{module.__name__}.{name} is exported but not defined"
    if hasattr(blobpipe, "__all__"):
        # a ``Name as Name`` re-export is public by convention: __all__ lists it too
        assert set(REEXPORTS) <= set(blobpipe.__all__)


def test_nothing_private_leaks() -> None:
    for module, name in ALL:
        assert not name.startswith("_"), f"{module.__name__} exports a private name: {name}"
        obj = getattr(module, name)
        if _is_api_object(obj):
            # defined in blobpipe, under its own name (not an alias of a private one)
            assert obj.__module__.startswith("blobpipe."), (name, obj.__module__)
            assert obj.__name__ == name, f"{name} is an alias of {obj.__name__}"
    # the package namespace holds the API, public subpackages, and nothing else
    # (``annotations`` is the ``from __future__`` feature of the module itself)
    extra = [
        name
        for name, value in vars(blobpipe).items()
        if not name.startswith("_")
        and name not in EXPORTED
        and not isinstance(value, (types.ModuleType, __future__._Feature))
    ]
    assert not extra, f"public-looking names outside the API: {extra}"
    for name, value in vars(blobpipe).items():
        if isinstance(value, types.ModuleType) and not name.startswith("_"):
            assert value.__name__ == f"blobpipe.{name}", f"blobpipe.{name} is another package"


def test_version() -> None:
    assert isinstance(blobpipe.__version__, str)
    assert blobpipe.__version__.split(".")[0].isdigit()


# -- documented and annotated ----------------------------------------------------------------


def _documented_constant(module_name: str, name: str) -> bool:
    """A ``#:`` comment right above the constant's assignment, or a string right after it."""
    module = sys.modules[module_name]
    source = inspect.getsource(module)
    lines = source.splitlines()
    tree = ast.parse(source)
    for i, node in enumerate(tree.body):
        target = (
            node.target
            if isinstance(node, ast.AnnAssign)
            else node.targets[0]
            if isinstance(node, ast.Assign) and len(node.targets) == 1
            else None
        )
        if isinstance(target, ast.Name) and target.id == name:
            comment = node.lineno >= 2 and lines[node.lineno - 2].lstrip().startswith("#:")
            after = tree.body[i + 1] if i + 1 < len(tree.body) else None
            string = (
                isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            )
            return bool(comment or string)
    return False


@pytest.mark.parametrize("case", ALL, ids=_id)
def test_documented(case: tuple[types.ModuleType, str]) -> None:
    module, name = case
    obj = getattr(module, name)
    if _is_api_object(obj):
        doc = obj.__doc__  # its own: a class does not inherit __doc__
        assert doc and doc.strip(), f"{name} has no docstring"
        # a dataclass without a docstring gets its signature as one
        assert not doc.startswith(f"{name}("), f"{name} has no docstring (only its signature)"
    else:
        owner = module.__name__
        if module is blobpipe and name in REEXPORTS:
            owner = "blobpipe" + REEXPORTS[name] if REEXPORTS[name].startswith(".") else owner
        assert _documented_constant(owner, name), f"{name} has no '#:' comment or docstring"


def _unannotated(func: Any) -> list[str]:
    sig = inspect.signature(func)
    missing = [
        p.name
        for i, p in enumerate(sig.parameters.values())
        if p.annotation is inspect.Parameter.empty and not (i == 0 and p.name in ("self", "cls"))
    ]
    if sig.return_annotation is inspect.Signature.empty:
        missing.append("return")
    return missing


def _public_functions(cls: type) -> dict[str, Any]:
    """``__init__`` and the public methods and properties that blobpipe itself defines."""
    found: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if not klass.__module__.startswith("blobpipe"):
            continue
        for attr, value in vars(klass).items():
            if attr.startswith("_") and attr != "__init__":
                continue
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            elif isinstance(value, property):
                value = value.fget
            if inspect.isfunction(value):
                found[attr] = value
    return found


@pytest.mark.parametrize("case", ALL, ids=_id)
def test_annotated(case: tuple[types.ModuleType, str]) -> None:
    module, name = case
    obj = getattr(module, name)
    if inspect.isclass(obj):
        for attr, func in _public_functions(obj).items():
            missing = _unannotated(func)
            assert not missing, f"{name}.{attr}: no annotation for {missing}"
    elif inspect.isroutine(obj):
        missing = _unannotated(obj)
        assert not missing, f"{name}: no annotation for {missing}"


# -- importing is light ----------------------------------------------------------------------


@pytest.mark.parametrize("statement", ["import blobpipe", "import blobpipe.testing"])
def test_import_loads_no_device_library_or_image_decoder(statement: str) -> None:
    code = f"import json, sys; {statement}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    loaded = set(json.loads(out))
    heavy = sorted(m for m in HEAVY if m in loaded)
    assert not heavy, f"{statement!r} imported {heavy}"
