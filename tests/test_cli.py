"""The ``blobpipe`` command line: commands, exit codes, progress on a terminal, kill -9."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from blobpipe._cli import main
from blobpipe._tools._output import read_marker
from tests._helpers import lmdb_items

REPO = Path(__file__).resolve().parent.parent
CAFFE = REPO / "tests" / "data" / "caffe"
ROOT = f"{CAFFE / 'images'}/"
LIST = str(CAFFE / "list_color.txt")
RAW_FLAGS = ["--resize_height=32", "--resize_width=40"]
COMMANDS = ["convert-imageset", "compute-mean", "export", "inspect", "bench", "show"]


def run_cli(*args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "blobpipe", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
        **kw,  # type: ignore[arg-type]
    )


# -- help and usage ------------------------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_examples(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert f"usage: blobpipe {command}" in out
    assert "examples:" in out
    assert f"blobpipe {command} " in out.split("examples:")[1]


def test_top_level_help_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in COMMANDS:
        assert command in out
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("blobpipe ")


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["bogus"],
        ["convert-imageset", ROOT, LIST],
        ["convert-imageset", "--resize-height", "-3", ROOT, LIST, "x"],
        ["convert-imageset", "--encode-type", "gif", ROOT, LIST, "x"],
        ["export", "db", "out", "--shard", "4/4"],
        ["export", "db", "out", "--shard", "1"],
        ["export", "db", "out", "--shard", "a/b"],
        ["export", "db", "out", "--shard", "-1/2"],
        ["bench", "db", "--batch-size", "0"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "usage: blobpipe" in err
    if "--shard" in argv:
        assert "shard" in err.splitlines()[-1]


def test_python_dash_m_runs_the_cli() -> None:
    proc = run_cli("--version")
    assert proc.returncode == 0
    assert proc.stdout.startswith("blobpipe ")


# -- convert-imageset --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "flags"),
    [("raw_color", RAW_FLAGS), ("encoded_jpg", [*RAW_FLAGS, "--encoded", "--encode_type=jpg"])],
)
def test_convert_with_caffes_flags_matches_caffe(
    tmp_path: Path, name: str, flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / name
    assert main(["convert-imageset", *flags, ROOT, LIST, str(out)]) == 0
    assert lmdb_items(out) == lmdb_items(CAFFE / "lmdb" / name)
    captured = capsys.readouterr()
    assert captured.out == f"wrote 50 records to {str(out)!r} (0 of 50 list entries skipped)\n"
    assert captured.err == ""  # not a terminal: no progress bar


def test_convert_refuses_to_overwrite_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "db"
    assert main(["convert-imageset", "-q", ROOT, LIST, str(out)]) == 0
    before = lmdb_items(out)
    assert main(["convert-imageset", *RAW_FLAGS, ROOT, LIST, str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("blobpipe convert-imageset: error: output ")
    assert "--force" in err
    assert lmdb_items(out) == before
    assert main(["convert-imageset", "-q", "--force", *RAW_FLAGS, ROOT, LIST, str(out)]) == 0
    assert lmdb_items(out) == lmdb_items(CAFFE / "lmdb" / "raw_color")


def test_convert_reports_missing_inputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["convert-imageset", str(tmp_path / "none"), LIST, str(tmp_path / "db")]) == 1
    assert "the image root does not exist" in capsys.readouterr().err
    assert main(["convert-imageset", ROOT, str(tmp_path / "none.txt"), str(tmp_path / "db")]) == 1
    assert "the list file does not exist" in capsys.readouterr().err
    lst = tmp_path / "l.txt"
    lst.write_text("color/china_00.jpg 1\ncolor/gone.jpg 2\n")
    assert main(["convert-imageset", "-q", ROOT, str(lst), str(tmp_path / "db")]) == 0
    err = capsys.readouterr().err
    assert "skipped '00000001_color/gone.jpg'" in err
    assert "file not found" in err


def test_shuffle_seed_on_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("a", "b"):
        argv = ["convert-imageset", "--shuffle", "--seed", "7", ROOT, LIST, str(tmp_path / name)]
        assert main(argv) == 0
    assert "shuffled with seed 7" in capsys.readouterr().out
    assert lmdb_items(tmp_path / "a") == lmdb_items(tmp_path / "b")


# -- compute-mean, inspect, export, bench ----------------------------------------------------


def test_compute_mean_writes_caffes_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "mean.binaryproto"
    assert main(["compute-mean", str(CAFFE / "lmdb" / "raw_color"), str(out)]) == 0
    assert out.read_bytes() == (CAFFE / "raw_color_mean.binaryproto").read_bytes()
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == [
        "mean_value channel [0]: 96.6124",
        "mean_value channel [1]: 108.506",
        "mean_value channel [2]: 117.636",
    ]
    assert main(["compute-mean", str(CAFFE / "lmdb" / "raw_color"), str(out)]) == 1


def test_inspect_text_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    db = str(CAFFE / "lmdb" / "encoded_jpg")
    assert main(["inspect", db]) == 0
    text = capsys.readouterr().out
    assert "records:   50" in text
    assert "00000000_color/china_00.jpg" in text
    assert "kinds:     encoded 50" in text
    assert "3 x 32 x 40: 50" in text
    assert "complete)" in text
    assert main(["inspect", "--json", db]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["records"] == 50
    assert data["kinds"] == {"encoded": 50}
    assert data["shapes"] == [{"shape": [3, 32, 40], "count": 50}]
    assert data["labels"]["max"] == 1099


def test_inspect_missing_db_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(tmp_path / "nope")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("blobpipe inspect: error: no such file or directory; check the path")
    (tmp_path / "empty").mkdir()
    assert main(["inspect", str(tmp_path / "empty")]) == 1
    err = capsys.readouterr().err
    assert "neither data.mdb (an LMDB) nor CURRENT (a LevelDB); it is empty" in err


def test_export_with_transform_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ref = CAFFE / "ref" / "raw_color_b8_meanvalue_crop24"
    expected = np.concatenate([np.load(ref / f"data_b{k}.npy") for k in range(2)])
    out = tmp_path / "o.npz"
    argv = ["export", str(CAFFE / "lmdb" / "raw_color"), str(out), "--limit", "16",
            "--crop-size", "24", "--mean-value", "104", "--mean-value", "117",
            "--mean-value", "123"]  # fmt: skip
    assert main(argv) == 0
    assert "exported 16 records" in capsys.readouterr().out
    with np.load(out) as z:
        np.testing.assert_array_equal(z["data"], expected)
    assert main(argv) == 1
    assert "already exists" in capsys.readouterr().err


def test_bench_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", str(CAFFE / "lmdb" / "raw_color"), "--batches", "5", "--batch-size", "4"]
    assert main([*argv, "--json", "-q"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["batches"] == 5
    assert data["records"] == 20
    assert data["records_per_s"] > 0
    assert main(argv) == 0
    assert "records/s" in capsys.readouterr().out


# -- progress on a terminal -------------------------------------------------------------------


def _run_on_pty(args: list[str]) -> tuple[int, str, str]:
    """Run the CLI with stderr on a pseudo-terminal; returns (rc, stdout, terminal text)."""
    master, slave = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "blobpipe", *args],
        stdout=subprocess.PIPE,
        stderr=slave,
        env=env,
        text=True,
    )
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.1)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(master)
    out, _ = proc.communicate(timeout=30)
    return proc.returncode, out, b"".join(chunks).decode(errors="replace")


def test_progress_bar_on_a_terminal_and_quiet(tmp_path: Path) -> None:
    rc, out, term = _run_on_pty(["convert-imageset", *RAW_FLAGS, ROOT, LIST, str(tmp_path / "a")])
    assert rc == 0
    assert "\rconvert" in term
    assert "50/50 records" in term
    assert "records/s" in term
    assert "wrote 50 records" in out
    rc, out, term = _run_on_pty(["convert-imageset", "-q", ROOT, LIST, str(tmp_path / "b")])
    assert rc == 0
    assert term == ""
    assert out == ""


def test_messages_name_the_flags_on_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CLI says ``--force`` where Python says ``force=True``."""
    out = tmp_path / "db"
    out.mkdir()
    assert main(["convert-imageset", "-q", ROOT, LIST, str(out)]) == 1
    err = capsys.readouterr().err
    assert err.endswith("already exists; pass --force to replace it\n"), err
    grid = tmp_path / "grid.png"
    grid.write_bytes(b"")
    assert main(["show", str(CAFFE / "lmdb" / "raw_color"), "-o", str(grid)]) == 1
    err = capsys.readouterr().err
    assert "pass --force to replace it" in err and "force=True" not in err


def test_a_conversion_that_writes_nothing_exits_1_and_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lst = tmp_path / "l.txt"
    lst.write_text("gone/a.jpg 1\ngone/b.jpg 2\n")
    assert main(["convert-imageset", ROOT, str(lst), str(tmp_path / "db")]) == 1
    captured = capsys.readouterr()
    assert "wrote" not in captured.out
    last = captured.err.splitlines()[-1]
    assert last.startswith("blobpipe convert-imageset: error: no record written: all 2 list")
    assert not (tmp_path / "db").exists() and not (tmp_path / "db.partial").exists()


def test_loose_labels_are_reported_once_and_refused_with_strict_labels(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lst = tmp_path / "l.txt"
    lst.write_text("color/china_00.jpg 3.7\ncolor/china_01.jpg 12abc\n")
    assert main(["convert-imageset", "-q", ROOT, str(lst), str(tmp_path / "db")]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "line 1: label '3.7' is not an integer; read as Caffe's atoi reads it, as 3" in err
    assert "pass --strict-labels to refuse such labels" in err
    argv = ["convert-imageset", "--strict-labels", ROOT, str(lst), str(tmp_path / "strict")]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "line 1: label '3.7' is not an integer (--strict-labels;" in err


def test_no_progress_bar_when_piped(tmp_path: Path) -> None:
    proc = run_cli("convert-imageset", ROOT, LIST, str(tmp_path / "db"))
    assert proc.returncode == 0
    assert proc.stderr == ""


# -- kill -9 in the middle of a conversion ---------------------------------------------------

# The child takes Ctrl-C as Python does by default, whatever the disposition it
# inherited (a test run under nohup or in a background job ignores SIGINT, and an
# ignored signal stays ignored across exec).
_SLOW_CONVERT = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
from blobpipe._tools import _convert
real = _convert._read_image
def slow(filename, is_color):
    time.sleep(0.05)
    return real(filename, is_color)
_convert._read_image = slow
from blobpipe._cli import main
sys.exit(main(sys.argv[1:]))
"""


def stalled_convert(after: int) -> str:
    """The slow conversion, waiting after its ``after``-th image (a Ctrl-C or a kill
    ends the wait), so a signal lands mid-conversion however slowly the machine runs."""
    return _SLOW_CONVERT.replace(
        "    time.sleep(0.05)\n",
        "    slow.n = getattr(slow, 'n', 0) + 1\n"
        f"    time.sleep(0.05 if slow.n <= {after} else 120)\n",
    )


def test_killed_conversion_leaves_a_valid_incomplete_db_and_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "db"
    partial = tmp_path / "db.partial"
    argv = ["convert-imageset", "-q", "--commit-every", "3", *RAW_FLAGS, ROOT, LIST, str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", stalled_convert(15), *argv], env=env)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            marker = read_marker(partial)
            if marker is not None and marker["next_index"] >= 12:
                break
            time.sleep(0.01)
        else:
            pytest.fail("the conversion made no progress")
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists()
    marker = read_marker(partial)
    assert marker is not None
    assert not marker["complete"]
    done = marker["next_index"]
    assert 12 <= done < 50
    # a valid LMDB with at least the committed records, all of them Caffe's
    items = lmdb_items(partial)
    caffe = dict(lmdb_items(CAFFE / "lmdb" / "raw_color"))
    assert len(items) >= done
    assert all(caffe[k] == v for k, v in items)

    assert main(["inspect", str(partial)]) == 0
    assert "INCOMPLETE" in capsys.readouterr().out
    assert main(["inspect", str(out)]) == 1
    assert "rerun the same convert-imageset command" in capsys.readouterr().err

    assert main(argv) == 0
    assert "resuming the conversion" in capsys.readouterr().err
    assert lmdb_items(out) == lmdb_items(CAFFE / "lmdb" / "raw_color")
    assert not partial.exists()


def test_ctrl_c_reports_what_is_committed_and_exits_130(tmp_path: Path) -> None:
    out = tmp_path / "db"
    argv = ["convert-imageset", "-q", "--commit-every", "2", ROOT, LIST, str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", stalled_convert(6), *argv],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            marker = read_marker(tmp_path / "db.partial")
            if marker is not None and marker["next_index"] >= 4:
                break
            time.sleep(0.01)
        assert proc.poll() is None, "the conversion ended before the signal"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:  # no child and no pipe outlive the test, whatever failed
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    assert proc.returncode == 130
    assert err.count("\n") == 1
    assert err.startswith("blobpipe convert-imageset: interrupted: ")
    assert "rerun the same command to resume" in err
    assert not out.exists()
    resumes_from(err, tmp_path / "db.partial")


def resumes_from(err: str, partial: Path) -> int:
    """The line an interrupted conversion's message says a rerun resumes at, checked
    against the marker on disk: its next line, and its records (the lines before it less
    those it skipped)."""
    marker = read_marker(partial)
    assert marker is not None
    at = re.search(r"(\d+) records \(list lines up to (\d+) of 50\).*resume at line (\d+)", err)
    assert at is not None, err
    records, upto, resume = map(int, at.groups())
    assert upto == resume == marker["next_index"]
    assert records == resume - len(marker["skipped"]) > 0
    return resume


@pytest.mark.parametrize("when", ["before", "after"])
def test_an_interruption_at_a_commit_reports_what_the_marker_on_disk_resumes_from(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    when: str,
) -> None:
    """A Ctrl-C landing just before or just after a commit's marker is written: the
    message's line and records are the marker's on disk, what a rerun resumes from (a
    count kept in memory beside it said 2 records of 4 lines once)."""
    import blobpipe._tools._convert as convert

    real = convert.write_marker
    written: list[int] = []

    def interrupted(partial: Path, marker: dict[str, Any]) -> None:
        if len(written) == 2:  # the empty marker, the first commit: now the second
            if when == "after":
                real(partial, marker)
            raise KeyboardInterrupt
        real(partial, marker)
        written.append(int(marker["next_index"]))

    monkeypatch.setattr(convert, "write_marker", interrupted)
    argv = ["convert-imageset", "-q", "--commit-every", "2", ROOT, LIST, str(tmp_path / "db")]
    assert main(argv) == 130
    resume = resumes_from(capsys.readouterr().err, tmp_path / "db.partial")
    # before: the first commit's marker stays; after: the second's replaced it
    assert (resume == written[-1]) if when == "before" else (resume > written[-1])


# -- Caffe's own scripts ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "flags"),
    [
        ("raw_color", ["-resize_height=32", "--resize_width", "40", "--shuffle=false"]),
        ("raw_color", ["--backend=lmdb", "--gray=false", "-resize_width=40", "-resize_height=32"]),
        (
            "encoded_jpg",
            ["--resize_height=32", "--resize_width=40", "--encoded=true", "-encode_type=jpg"],
        ),
        ("raw_color", ["--noshuffle", "--check_size=0", *RAW_FLAGS]),
    ],
)
def test_convert_takes_caffes_gflags_spellings(tmp_path: Path, name: str, flags: list[str]) -> None:
    out = tmp_path / name
    assert main(["convert-imageset", "-q", *flags, ROOT, LIST, str(out)]) == 0
    assert lmdb_items(out) == lmdb_items(CAFFE / "lmdb" / name)


def test_caffes_create_script_runs_with_tools_pointing_at_blobpipe(tmp_path: Path) -> None:
    """The lines of Caffe's examples/imagenet/create_imagenet.sh and make_imagenet_mean.sh,
    Caffe's tool names and flags as they are, ``$TOOLS/`` replaced by ``blobpipe `` (and
    the paths by the test data's)."""
    script = tmp_path / "create.sh"
    script.write_text(
        "set -e\n"
        "RESIZE_HEIGHT=32\n"
        "RESIZE_WIDTH=40\n"
        'TOOLS="$PYTHON -m blobpipe"\n'
        "GLOG_logtostderr=1 $TOOLS convert_imageset \\\n"
        "    --resize_height=$RESIZE_HEIGHT \\\n"
        "    --resize_width=$RESIZE_WIDTH \\\n"
        "    --shuffle=false \\\n"
        "    --backend=lmdb \\\n"
        f"    {ROOT} \\\n"
        f"    {LIST} \\\n"
        f"    {tmp_path}/train_lmdb\n"
        f"$TOOLS compute_image_mean -backend=lmdb {tmp_path}/train_lmdb "
        f"{tmp_path}/mean.binaryproto\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert lmdb_items(tmp_path / "train_lmdb") == lmdb_items(CAFFE / "lmdb" / "raw_color")
    mean = (tmp_path / "mean.binaryproto").read_bytes()
    assert mean == (CAFFE / "raw_color_mean.binaryproto").read_bytes()


@pytest.mark.parametrize(
    "argv",
    [
        ["convert-imageset", "--backend=rocksdb", "a/", "l.txt", "db"],
        ["compute-mean", "-backend=rocksdb", "db"],
        ["convert-imageset", "--shuffle=maybe", "a/", "l.txt", "db"],
    ],
)
def test_gflags_that_cannot_mean_anything_are_usage_errors(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"blobpipe {argv[0]}: error:" in err
    assert ("reads and writes LMDB and LevelDB" in err) == ("backend" in " ".join(argv))


# -- pipes, usage, what inspect prints -------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", str(CAFFE / "lmdb" / "encoded_jpg"), "--first", "50"],
        ["inspect", "--json", str(CAFFE / "lmdb" / "raw_color")],
        ["compute-mean", str(CAFFE / "lmdb" / "raw_color")],
    ],
    ids=["inspect", "inspect-json", "compute-mean"],
)
def test_a_closed_stdout_ends_the_command_quietly(argv: list[str]) -> None:
    """``blobpipe inspect db | head -1``: the reader is gone before blobpipe writes."""
    read, write = os.pipe()
    os.close(read)  # every write to the pipe fails: EPIPE
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with os.fdopen(write, "wb") as out:
        proc = subprocess.run(
            [sys.executable, "-m", "blobpipe", *argv],
            stdout=out,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )
    assert proc.returncode == 0
    assert proc.stderr == ""


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["inspect", "--bogus", "db"], "usage: blobpipe inspect"),
        (["export", "db", "out", "--frobnicate"], "usage: blobpipe export"),
        (["compute-mean", "-backend=rocksdb", "db"], "usage: blobpipe compute-mean"),
        (["convert-imageset", "--shuffle=maybe", "a/", "l.txt", "db"], "usage: blobpipe convert"),
    ],
)
def test_usage_errors_print_the_commands_usage(
    argv: list[str], usage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(usage), err
    assert "usage: blobpipe [-h]" not in err


def test_inspect_escapes_control_bytes_in_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import blobpipe

    image = np.zeros((1, 2, 2), np.uint8)
    keys = [b"\x1b[2Jclear", b"nul\x00bel\x07", b"plain"]
    db = tmp_path / "db"
    blobpipe.write_lmdb(db, [(image, i) for i in range(3)], keys=keys)
    assert main(["inspect", str(db)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x00" not in out and "\x07" not in out
    assert "  \\x1b[2Jclear" in out and "  nul\\x00bel\\x07" in out and "  plain" in out


def test_inspect_reads_a_directory_it_cannot_list(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A directory that can be entered but not listed (mode 0o311 for another user;
    the test may run as root, so listing is refused by a patch): read as the Loader
    reads it, by the names of LMDB's files."""
    import shutil

    db = tmp_path / "db"
    shutil.copytree(CAFFE / "lmdb" / "raw_color", db)

    def refuse(self: Path) -> object:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "iterdir", refuse)
    monkeypatch.setattr(os, "listdir", lambda *a: refuse(Path(str(a[0]) if a else ".")))
    monkeypatch.setattr(os, "scandir", lambda *a: refuse(Path(str(a[0]) if a else ".")))
    assert main(["inspect", str(db)]) == 0
    assert "records:   50" in capsys.readouterr().out


# -- show ------------------------------------------------------------------------------------


def test_show_draws_each_record_in_its_true_colours(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import cv2

    import blobpipe
    from blobpipe._tools._show import show_grid

    db = CAFFE / "lmdb" / "raw_color"
    out = tmp_path / "grid.png"
    assert main(["show", str(db), "-o", str(out), "--count", "6", "--columns", "3"]) == 0
    assert f"wrote 6 records of {str(db)!r}" in capsys.readouterr().out
    png = cv2.imread(str(out), cv2.IMREAD_UNCHANGED)  # BGR, as the records
    layout = show_grid(db, tmp_path / "again.png", count=6, columns=3)
    assert layout.zoom == 3 and layout.columns == 3
    reader = blobpipe.LmdbReader(db)
    for i, key in enumerate(reader.keys()[:6]):
        chw, label = blobpipe.decode_datum(reader.get(key))
        want = chw.transpose(1, 2, 0).repeat(3, axis=0).repeat(3, axis=1)
        y, x = layout.origin(i)
        assert np.array_equal(png[y : y + 96, x : x + 120], want), key
        assert layout.keys[i] == key and layout.labels is not None
        assert layout.labels[i] == label
    reader.close()


def test_show_draws_whole_keys_on_as_many_lines_as_they_need(tmp_path: Path) -> None:
    """A key wider than its column goes on over several caption lines, never cut;
    the images stay where the layout says."""
    import cv2

    import blobpipe
    from blobpipe._io._image import text_width
    from blobpipe._tools._show import show_grid
    from tests._helpers import image, write_lmdb

    keys = [b"%08d_cats/a_rather_long_file_name_%d.jpg" % (i, i) for i in range(3)]
    keys.append(b"00000003_dog.jpg")
    records = [(k, blobpipe.encode_raw_datum(image(i, (3, 4, 5)), i)) for i, k in enumerate(keys)]
    db = write_lmdb(tmp_path / "db", records)
    layout = show_grid(db, tmp_path / "g.png", zoom=2, columns=2)
    png = cv2.imread(str(tmp_path / "g.png"), cv2.IMREAD_UNCHANGED)
    for i, key in enumerate(layout.keys):
        *key_lines, label = layout.captions[i]
        assert "".join(key_lines) == key.decode(), key_lines
        assert all(text_width(line) <= layout.column_width for line in key_lines)
        assert label == f"label {i}"
        y, x = layout.origin(i)
        want = image(i, (3, 4, 5)).transpose(1, 2, 0).repeat(2, axis=0).repeat(2, axis=1)
        assert np.array_equal(png[y : y + 8, x : x + 10], want)
    assert len(layout.captions[0]) > 2  # the long keys took more than one line
    assert layout.caption_height == 12 * max(len(c) for c in layout.captions) + 4


def test_show_draws_transformed_rows_and_gray(tmp_path: Path) -> None:
    import cv2

    import blobpipe
    from blobpipe._tools._show import show_grid

    gray = [(np.full((1, 4, 5), 10 * i, np.uint8), i) for i in range(4)]
    db = tmp_path / "gray"
    blobpipe.write_lmdb(db, gray)
    layout = show_grid(db, tmp_path / "g.png", zoom=1)
    png = cv2.imread(str(tmp_path / "g.png"), cv2.IMREAD_UNCHANGED)
    for i in range(4):
        y, x = layout.origin(i)
        assert (png[y : y + 4, x : x + 5] == 10 * i).all()  # gray in all three channels
    # a crop through the transform: the centre of each record, as Batches cuts it
    db = CAFFE / "lmdb" / "raw_color"
    t = blobpipe.Transform(crop_size=24, dtype="uint8")
    layout = show_grid(db, tmp_path / "c.png", count=4, transform=t, zoom=1)
    png = cv2.imread(str(tmp_path / "c.png"), cv2.IMREAD_UNCHANGED)
    with blobpipe.Batches(db, 4, transform=t, phase="test") as batches:
        rows = next(iter(batches)).data
    for i in range(4):
        y, x = layout.origin(i)
        assert np.array_equal(png[y : y + 24, x : x + 24], rows[i].transpose(1, 2, 0))
    with pytest.raises(blobpipe.ArgumentError, match="PNG"):
        show_grid(db, tmp_path / "grid.jpg")
