"""The ``blobpipe`` command line: Caffe's dataset tools and the way out to blobs.

Exit codes: 0 success, 1 failure (one ``blobpipe <command>: error: ...`` line
on stderr), 2 usage error, 130 interrupted. Progress bars go to stderr, only on
a terminal and never with ``--quiet``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from . import __version__
from ._errors import BlobpipeError, command_line

__all__ = ["main"]

_Handler = Callable[[argparse.Namespace], int]


def _err(command: str, message: str) -> None:
    print(f"blobpipe {command}: {message}", file=sys.stderr, flush=True)


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _positive(text: str) -> int:
    value = _non_negative(text)
    if value == 0:
        raise argparse.ArgumentTypeError("expected an integer >= 1, got 0")
    return value


def _parser_with(sub: Any, name: str, summary: str, examples: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(
        name,
        help=summary,
        description=summary,
        epilog="examples:\n" + examples,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "-q", "--quiet", action="store_true", help="no progress bar and no summary line"
    )
    return parser


# -- convert-imageset -------------------------------------------------------


def _cmd_convert(args: argparse.Namespace) -> int:
    from ._tools import convert_imageset

    def report(message: str) -> None:
        _err("convert-imageset", message)

    try:
        result = convert_imageset(
            args.root,
            args.listfile,
            args.db,
            resize_height=args.resize_height,
            resize_width=args.resize_width,
            gray=args.gray,
            shuffle=args.shuffle,
            seed=args.seed,
            encoded=args.encoded,
            encode_type=args.encode_type,
            check_size=args.check_size,
            strict_labels=args.strict_labels,
            force=args.force,
            commit_every=args.commit_every,
            quiet=args.quiet,
            report=report,
            backend=args.backend,
        )
    except KeyboardInterrupt:
        return 130  # convert_imageset has reported what is committed and how to resume
    if not args.quiet:
        seed = f", shuffled with seed {result.seed}" if result.seed is not None else ""
        print(
            f"wrote {result.records} records to {str(result.path)!r} "
            f"({len(result.skipped)} of {result.lines} list entries skipped{seed})"
        )
    return 0


def _add_convert(sub: Any) -> None:
    p = _parser_with(
        sub,
        "convert-imageset",
        "Convert images and a Caffe list file into an LMDB (or a LevelDB) of Datums (Caffe's "
        "convert_imageset, a name this command answers to as well).",
        "  blobpipe convert-imageset --resize-height 32 --resize-width 40 images/ list.txt db\n"
        "  blobpipe convert-imageset --encoded --encode-type jpg images/ list.txt train_jpg_lmdb\n"
        "  blobpipe convert-imageset --shuffle --seed 1 --gray images/ list.txt gray_lmdb\n"
        "\n"
        "LISTFILE lines are 'relative/path label' (split at the last space); keys are\n"
        "'%08d_<path>' with the line index. Unreadable images are reported and skipped;\n"
        "a conversion that writes no record fails (exit 1) and leaves no database.\n"
        "The database is built in DB.partial and renamed to DB when complete; after an\n"
        "interruption the same command resumes it.",
    )
    p.add_argument("root", metavar="ROOT", help="folder the list file's paths are relative to")
    p.add_argument("listfile", metavar="LISTFILE", help="lines of 'path label'")
    p.add_argument("db", metavar="DB", help="output LMDB directory (must not exist)")
    p.add_argument(
        "--resize-height",
        "--resize_height",
        type=_non_negative,
        default=0,
        metavar="H",
        help="resize to this height (with --resize-width; 0: keep)",
    )
    p.add_argument(
        "--resize-width",
        "--resize_width",
        type=_non_negative,
        default=0,
        metavar="W",
        help="resize to this width (with --resize-height; 0: keep)",
    )
    p.add_argument("--gray", action="store_true", help="read images as 1-channel grayscale")
    p.add_argument("--shuffle", action="store_true", help="shuffle the list before converting")
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="shuffle seed (reproducible; default: random, printed at the end)",
    )
    p.add_argument(
        "--encoded",
        action="store_true",
        help="store encoded images (the file itself when it already matches)",
    )
    p.add_argument(
        "--encode-type",
        "--encode_type",
        default="",
        choices=["jpg", "png"],
        help="encode as jpg or png (implies --encoded)",
    )
    p.add_argument(
        "--check-size",
        "--check_size",
        action="store_true",
        help="fail unless every image has the same size",
    )
    p.add_argument(
        "--strict-labels",
        "--strict_labels",
        action="store_true",
        help="refuse labels that are not plain integers (by default they are read as "
        "Caffe's atoi reads them, '3.7' as 3, and reported once)",
    )
    p.add_argument("--force", action="store_true", help="replace DB if it exists")
    p.add_argument(
        "--backend",
        choices=["lmdb", "leveldb"],
        default="lmdb",
        help="the database to write (default lmdb; leveldb as Caffe's --backend=leveldb)",
    )
    p.add_argument(
        "--commit-every",
        type=_positive,
        default=1000,
        metavar="N",
        help="records per LMDB transaction or LevelDB write batch (default 1000, as Caffe)",
    )
    p.set_defaults(handler=_cmd_convert)


# -- compute-mean -----------------------------------------------------------


def _cmd_mean(args: argparse.Namespace) -> int:
    from ._tools import compute_mean

    result = compute_mean(args.db, args.out, force=args.force, quiet=args.quiet)
    for c, value in enumerate(result.channel_means):
        print(f"mean_value channel [{c}]: {value:.6g}")
    if not args.quiet and args.out is not None:
        print(f"wrote the mean of {result.count} records to {args.out!r}")
    return 0


def _add_mean(sub: Any) -> None:
    p = _parser_with(
        sub,
        "compute-mean",
        "Per-pixel mean of an LMDB or LevelDB as a Caffe mean file (Caffe's "
        "compute_image_mean, a name this command answers to as well).",
        "  blobpipe compute-mean train_lmdb mean.binaryproto\n"
        "  blobpipe compute-mean train_lmdb            # print the channel means only\n",
    )
    p.add_argument("db", metavar="DB", help="input LMDB or LevelDB of Datums")
    p.add_argument(
        "out",
        metavar="OUT.binaryproto",
        nargs="?",
        default=None,
        help="where to write the mean BlobProto",
    )
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.set_defaults(handler=_cmd_mean)


# -- transform options (export, bench) ----------------------------------------


def _add_transform_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("transform (Caffe's transform_param; TEST phase)")
    g.add_argument(
        "--mean-file",
        "--mean_file",
        default=None,
        metavar="MEAN.binaryproto",
        help="subtract this mean image",
    )
    g.add_argument(
        "--mean-value",
        "--mean_value",
        type=float,
        action="append",
        default=None,
        metavar="V",
        help="subtract this value (repeat once per channel)",
    )
    g.add_argument("--scale", type=float, default=1.0, help="multiply after the mean (default 1)")
    g.add_argument(
        "--crop-size",
        "--crop_size",
        type=_non_negative,
        default=0,
        metavar="N",
        help="centre crop to N x N",
    )
    g.add_argument("--mirror", action="store_true", help="flip records (seeded, per record)")
    g.add_argument(
        "--force-color",
        "--force_color",
        action="store_true",
        help="decode encoded records as 3-channel BGR",
    )
    g.add_argument(
        "--force-gray",
        "--force_gray",
        action="store_true",
        help="decode encoded records as 1-channel gray",
    )
    g.add_argument("--layout", choices=["NCHW", "NHWC"], default="NCHW", help="output layout")
    g.add_argument(
        "--dtype",
        choices=["float32", "uint8"],
        default="float32",
        help="float32 (Caffe) or uint8 (raw pixels: no mean or scale)",
    )


def _transform(args: argparse.Namespace) -> Any:
    from ._io._transform import Transform

    return Transform(
        scale=args.scale,
        mirror=args.mirror,
        crop_size=args.crop_size,
        mean_file=args.mean_file,
        mean_value=tuple(args.mean_value or ()),
        force_color=args.force_color,
        force_gray=args.force_gray,
        layout=args.layout,
        dtype=args.dtype,
    )


# -- export -----------------------------------------------------------------


def _shard(text: str) -> tuple[int, int]:
    """``"I/N"`` → ``(I, N)`` with ``0 <= I < N``."""
    try:
        index_s, count_s = text.split("/")
        index, count = int(index_s), int(count_s)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"shard must look like I/N (e.g. 0/4), got {text!r}"
        ) from None
    if count < 1 or not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"shard I/N needs 0 <= I < N, got {text!r}")
    return index, count


def _cmd_export(args: argparse.Namespace) -> int:
    from ._tools import export

    result = export(
        args.db,
        args.out,
        format=args.format,
        transform=_transform(args),
        batch_size=args.batch_size,
        limit=args.limit,
        shard=args.shard,
        force=args.force,
        quiet=args.quiet,
    )
    if not args.quiet:
        print(
            f"exported {result.count} records to {str(result.path)!r} ({result.format}): "
            f"data {result.dtype} {result.shape}, labels float32 ({result.count},)"
        )
    return 0


def _add_export(sub: Any) -> None:
    p = _parser_with(
        sub,
        "export",
        "Export an LMDB or LevelDB to blobs: a directory of .npy files, an .npz, or a "
        "BlobProtoVector.",
        "  blobpipe export train_lmdb train_npy            # train_npy/data.npy + labels.npy\n"
        "  blobpipe export train_lmdb train.npz --mean-file mean.binaryproto --scale 0.017\n"
        "  blobpipe export train_lmdb train.binaryproto --limit 1000\n"
        "  blobpipe export train_lmdb part1.npz --shard 1/4   # every 4th record from the 2nd\n"
        "\n"
        "The format follows OUT's suffix (.npz, .binaryproto/.pb, else a directory of .npy)\n"
        "unless --format is given. Memory use is one batch: .npy files are written through\n"
        "memory maps. Reading the export back gives the loader's batches, concatenated.",
    )
    p.add_argument("db", metavar="DB", help="input LMDB or LevelDB of Datums")
    p.add_argument("out", metavar="OUT", help="output directory, .npz or .binaryproto")
    p.add_argument(
        "--format",
        choices=["npy", "npz", "binaryproto"],
        default=None,
        help="override the format implied by OUT",
    )
    p.add_argument(
        "--limit",
        type=_non_negative,
        default=None,
        metavar="N",
        help="export only the first N (selected) records",
    )
    p.add_argument(
        "--shard",
        type=_shard,
        default=None,
        metavar="I/N",
        help="export only records I, I+N, I+2N, ... (key order)",
    )
    p.add_argument(
        "--batch-size",
        type=_positive,
        default=256,
        metavar="B",
        help="records per batch (memory bound; default 256)",
    )
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    _add_transform_options(p)
    p.set_defaults(handler=_cmd_export)


# -- bench ------------------------------------------------------------------


def _cmd_bench(args: argparse.Namespace) -> int:
    from ._tools import bench

    seconds = args.seconds
    if seconds is None and args.batches is None:
        seconds = 5.0
    result = bench(
        args.db,
        batch_size=args.batch_size,
        transform=_transform(args),
        seconds=seconds,
        batches=args.batches,
        warmup=args.warmup,
        quiet=args.quiet,
        device=args.device,
        workers=args.workers,
    )
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(
            f"{result.records_per_s:,.0f} records/s  {result.batches_per_s:,.1f} batches/s  "
            f"{result.mb_per_s:,.1f} MB/s  ({result.batches} batches of {args.batch_size}, "
            f"{result.seconds:.2f} s; first batch after {result.first_batch_s * 1e3:.1f} ms)"
        )
    return 0


def _add_bench(sub: Any) -> None:
    p = _parser_with(
        sub,
        "bench",
        "Measure the loader's throughput on your database.",
        "  blobpipe bench train_lmdb\n"
        "  blobpipe bench train_lmdb --batch-size 256 --crop-size 227 --scale 0.017\n"
        "  blobpipe bench train_lmdb --batches 100 --json\n"
        "  blobpipe bench train_lmdb --device cpu --workers 2\n",
    )
    p.add_argument("db", metavar="DB", help="input LMDB or LevelDB of Datums")
    p.add_argument(
        "--batch-size",
        type=_positive,
        default=64,
        metavar="B",
        help="records per batch (default 64)",
    )
    p.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="time budget (default 5 s unless --batches is given)",
    )
    p.add_argument(
        "--batches", type=_positive, default=None, metavar="N", help="stop after N timed batches"
    )
    p.add_argument(
        "--warmup",
        type=_non_negative,
        default=2,
        metavar="N",
        help="untimed batches first (default 2)",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="auto (CUDA when available), cpu, cuda or cuda:N (default auto)",
    )
    p.add_argument(
        "--workers",
        type=_positive,
        default=None,
        metavar="N",
        help="worker threads filling records (default: the CPU count)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _add_transform_options(p)
    p.set_defaults(handler=_cmd_bench)


# -- inspect ----------------------------------------------------------------


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _printable(text: str) -> str:
    """``text`` with control characters (ESC, NUL, BEL, ...) escaped as Python
    writes them, so that a key cannot drive the terminal."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _cmd_inspect(args: argparse.Namespace) -> int:
    from ._tools import inspect_db

    if str(args.db).endswith(".prototxt"):  # a net's data layer: what it reads
        from ._tools._inspect import describe_layer

        print(json.dumps(describe_layer(args.db), indent=2))
        return 0
    info = inspect_db(args.db, limit=args.limit, first=args.first, quiet=args.quiet)
    if args.json:
        print(json.dumps(info.to_json(), indent=2))
        return 0
    data = info.to_json()
    status = "complete"
    if not info.complete:
        done, lines = info.progress or (0, 0)
        status = (
            f"INCOMPLETE (conversion stopped at line {done} of {lines}; "
            "rerun the same convert-imageset command to finish it)"
        )
    kind = "LevelDB, " if info.kind == "leveldb" else ""
    print(
        f"database:  {_printable(data['path'])}  ({kind}{_human(info.size_bytes)} on disk, "
        f"{status})"
    )
    scanned = "" if info.scanned == info.records else f"  (first {info.scanned} scanned)"
    print(f"records:   {info.records}{scanned}")
    print("first keys:")
    for key in data["first_keys"]:
        print(f"  {_printable(key)}")
    if not info.scanned:
        return 0
    print("kinds:     " + ", ".join(f"{k} {n}" for k, n in sorted(info.kinds.items())))
    print("shapes:")
    for item in data["shapes"]:
        print(f"  {' x '.join(str(d) for d in item['shape'])}: {item['count']}")
    labels = data["labels"]
    if not labels["distinct"]:
        print("labels:    none (BlobProto records)")
    else:
        common = ", ".join(f"{lab} ({n})" for lab, n in labels["most_common"])
        print(
            f"labels:    {labels['distinct']} distinct, min {labels['min']}, "
            f"max {labels['max']}; most common: {common}"
        )
    if info.errors:
        print(f"unreadable records: {len(info.errors)}")
        for key, msg in list(data["errors"].items())[:5]:
            print(f"  {_printable(key)}: {_printable(msg)}")
    return 0


def _add_inspect(sub: Any) -> None:
    p = _parser_with(
        sub,
        "inspect",
        "Summarise an LMDB or LevelDB: records, keys, Datum kinds, shapes, labels, size.",
        "  blobpipe inspect train_lmdb\n"
        "  blobpipe inspect --json train_lmdb | jq .shapes\n"
        "  blobpipe inspect --limit 1000 huge_lmdb   # scan only the first 1000 records\n",
    )
    p.add_argument(
        "db",
        metavar="DB",
        help="LMDB or LevelDB to inspect (also an unfinished DB.partial), or a net .prototxt: "
        "what its data layer reads (Data, ImageData, HDF5Data), as JSON",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--limit",
        type=_non_negative,
        default=None,
        metavar="N",
        help="scan only the first N records for kinds/shapes/labels",
    )
    p.add_argument(
        "--first",
        type=_non_negative,
        default=5,
        metavar="K",
        help="how many first keys to show (default 5)",
    )
    p.set_defaults(handler=_cmd_inspect)


# -- show -------------------------------------------------------------------


def _cmd_show(args: argparse.Namespace) -> int:
    from ._tools._output import check_output
    from ._tools._show import show_grid

    check_output(Path(args.output), force=args.force)
    if not (args.mean_file or args.mean_value or args.scale != 1.0):
        args.dtype = "uint8"  # no arithmetic: the records' own pixels
    transform = _transform(args)
    grid = show_grid(
        args.db, args.output, count=args.count, transform=transform,
        columns=args.columns, zoom=args.zoom,
    )  # fmt: skip
    if not args.quiet:
        print(
            f"wrote {grid.count} records of {_printable(str(args.db))!r} to "
            f"{_printable(str(grid.path))!r} ({grid.columns} per row, zoom {grid.zoom})"
        )
    return 0


def _add_show(sub: Any) -> None:
    p = _parser_with(
        sub,
        "show",
        "Draw the first records of an LMDB or LevelDB (or transformed batch rows) as a PNG grid, "
        "each with its key and label; BGR records are shown in their true colours.",
        "  blobpipe show train_lmdb -o grid.png\n"
        "  blobpipe show train_lmdb -o crops.png --count 64 --crop-size 24 --mirror\n",
    )
    p.add_argument(
        "db", metavar="DB", help="LMDB or LevelDB to draw, or a net .prototxt (its data layer)"
    )
    p.add_argument("-o", "--output", required=True, metavar="GRID.png", help="the PNG to write")
    p.add_argument("--count", type=_positive, default=16, metavar="N", help="records (16)")
    p.add_argument("--columns", type=_positive, default=None, metavar="K", help="per row")
    p.add_argument("--zoom", type=_positive, default=None, metavar="Z", help="pixel size")
    p.add_argument("--force", action="store_true", help="overwrite GRID.png")
    _add_transform_options(p)
    p.set_defaults(handler=_cmd_show)


# -- main -------------------------------------------------------------------


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="blobpipe",
        description="Caffe's dataset tools for modern Python: make, inspect and export LMDBs.",
        epilog="examples:\n"
        "  blobpipe convert-imageset --resize-height 32 --resize-width 40 images/ list.txt db\n"
        "  blobpipe compute-mean db mean.binaryproto\n"
        "  blobpipe inspect db\n"
        "  blobpipe export db out.npz\n"
        "  blobpipe bench db --batch-size 64\n"
        "  blobpipe show db -o grid.png\n"
        "\nRun 'blobpipe COMMAND --help' for a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"blobpipe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    parser.set_defaults(commands=sub.choices)  # each command's parser, for its usage
    _add_convert(sub)
    _add_mean(sub)
    _add_export(sub)
    _add_inspect(sub)
    _add_bench(sub)
    _add_show(sub)
    return parser


# Caffe's tool names, as its scripts call them: the same commands.
_CAFFE_NAMES = {"convert_imageset": "convert-imageset", "compute_image_mean": "compute-mean"}

# Caffe's tools take gflags: -flag=v or --flag=v or --flag v, booleans as --flag,
# --noflag or --flag=true|false. Per tool: its boolean flags and its other flags.
_GFLAGS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "convert-imageset": (
        frozenset({"gray", "shuffle", "check_size", "encoded"}),
        frozenset({"resize_width", "resize_height", "encode_type", "backend"}),
    ),
    "compute-mean": (frozenset(), frozenset({"backend"})),
}
_TRUE = frozenset({"true", "t", "yes", "y", "1"})
_FALSE = frozenset({"false", "f", "no", "n", "0"})


def _caffe_spellings(argv: list[str]) -> list[str]:
    """``argv`` with the gflags spellings of Caffe's own tools (as its scripts, e.g.
    ``create_imagenet.sh``, write them) turned into this CLI's: ``-resize_height=32``,
    ``--shuffle=true``, ``--gray=false``, ``--noshuffle``; ``--backend`` is lmdb or
    leveldb (what convert-imageset writes; compute-mean tells the kind from the
    directory) and any other backend is refused."""
    if not argv or argv[0] not in _GFLAGS:
        return argv
    booleans, others = _GFLAGS[argv[0]]
    out = [argv[0]]
    tokens = iter(argv[1:])
    for token in tokens:
        name, eq, value = token.lstrip("-").partition("=")
        name = name.replace("-", "_")
        if not token.startswith("-") or token in ("-", "--") or token.startswith("---"):
            out.append(token)
            continue
        negated = name.startswith("no") and name[2:] in booleans and not eq
        if name in booleans or negated:
            if negated:
                flag = False
            elif not eq:
                flag = True
            elif value.lower() in _TRUE | _FALSE:
                flag = value.lower() in _TRUE
            else:
                raise _UsageError(f"--{name} takes true or false, got {value!r}")
            if flag:
                out.append(f"--{name[2:] if negated else name}")
            continue
        if name in others:
            if not eq:
                value = next(tokens, "")
            if name == "backend":
                if value.lower() not in ("lmdb", "leveldb"):
                    raise _UsageError(
                        f"--backend={value}: blobpipe reads and writes LMDB and LevelDB "
                        "(a database's kind is told from its directory when it is read)"
                    )
                if argv[0] == "convert-imageset":
                    out.append(f"--backend={value.lower()}")
                continue
            out.append(f"--{name}={value}")
            continue
        out.append(token)
    return out


class _UsageError(Exception):
    """A command line that cannot mean anything (exit status 2)."""


def _command_parser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The parser of the command ``argv`` names (the top-level one when none)."""
    commands: dict[str, argparse.ArgumentParser] = parser.get_default("commands")
    for token in argv:
        if token in commands:
            return commands[token]
    return parser


def _quiet_broken_pipe() -> None:
    """The reader of stdout went away (``blobpipe inspect db | head -1``): send the
    rest of the output nowhere, so that the interpreter's final flush is silent."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    with contextlib.suppress(OSError, ValueError):
        os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``blobpipe`` command line; returns the exit code (0, 1, 2 or 130).

    A closed stdout (a pipe into ``head``) ends the command quietly with 0, as Unix
    tools do. Usage errors print the usage of the command they belong to.
    """
    parser = _build_parser()
    raw = list(sys.argv[1:] if argv is None else argv)
    if raw and raw[0] in _CAFFE_NAMES:
        raw[0] = _CAFFE_NAMES[raw[0]]
    try:
        raw = _caffe_spellings(raw)
    except _UsageError as exc:
        _command_parser(parser, raw).print_usage(sys.stderr)
        print(f"blobpipe {raw[0]}: error: {exc}", file=sys.stderr)
        return 2
    try:
        args, extra = parser.parse_known_args(raw)
        if extra:
            _command_parser(parser, raw).error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # argparse: --help/--version (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else 2
    handler: _Handler = args.handler
    try:
        with command_line():  # messages name options as flags (--force, not force=True)
            code = handler(args)
        sys.stdout.flush()  # a closed pipe shows here, not at the interpreter's exit
        return code
    except BrokenPipeError:
        _quiet_broken_pipe()
        return 0
    except KeyboardInterrupt:
        _err(args.command, "interrupted")
        return 130
    except (BlobpipeError, OSError, ValueError) as exc:
        _err(args.command, f"error: {exc}")
        return 1
