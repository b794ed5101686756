"""The examples run and do what they say."""

from __future__ import annotations

import importlib.util
import os
import re
import runpy
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import anyio
import pytest

from blobpipe import Batches
from blobpipe._backends import EmulatedBackend

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_train_digits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    example = runpy.run_path(str(EXAMPLES / "train_digits.py"), run_name="example")
    argv = ["--epochs", "5", "--device", "cpu", "--workers", "1", "--workdir", str(tmp_path)]
    result = example["run"](argv)
    assert result.device == "host"
    assert result.accuracy > 0.9
    assert len(result.losses) == 5
    assert all(a > b for a, b in pairwise(result.losses))
    assert result.records_per_second > 0
    out = capsys.readouterr().out
    assert "epoch   5: loss" in out
    assert f"test accuracy: {result.accuracy:.4f}" in out
    assert "records/s on host" in out
    # the LMDBs are Caffe's raw 1x8x8 Datums of the 80/20 split
    with Batches(tmp_path / "digits_train", 1437, mode="epoch") as train:
        batch = next(iter(train))
        assert batch.data.shape == (1437, 1, 8, 8)
        assert batch.data.max() == 255 and batch.data.min() == 0
        assert sorted(set(batch.label.tolist())) == list(range(10))
    with Batches(tmp_path / "digits_test", 360) as test:
        assert test.num_records == 360


def test_train_digits_main(capsys: pytest.CaptureFixture[str]) -> None:
    example = runpy.run_path(str(EXAMPLES / "train_digits.py"), run_name="example")
    assert example["main"](["--epochs", "1", "--device", "cpu", "--batch-size", "256"]) == 0
    assert "test accuracy" in capsys.readouterr().out


def test_train_digits_device_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The CUDA branch (gpu_data, mutable_gpu_diff, update on the device), emulated."""
    example = runpy.run_path(str(EXAMPLES / "train_digits.py"), run_name="example")
    args = example["parse_args"](["--epochs", "5", "--workers", "1"])
    args.device = EmulatedBackend()
    train_db, test_db = example["write_lmdbs"](tmp_path)
    result = anyio.run(example["train"], args, train_db, test_db)
    assert result.device == "emulated"
    assert result.accuracy > 0.9
    host = example["run"](["--epochs", "5", "--device", "cpu", "--workers", "1"])
    assert result.losses == pytest.approx(host.losses, rel=1e-4)
    assert "records/s on emulated" in capsys.readouterr().out


def test_segmentation(capsys: pytest.CaptureFixture[str]) -> None:
    example = runpy.run_path(str(EXAMPLES / "segmentation.py"), run_name="example")
    assert example["main"](["--records", "40", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.count("all agree") == 2
    assert "data (3, 48, 48), label (1, 48, 48)" in out
    # the check can fail: without shared crops the label maps no longer line up
    assert example["main"](["--records", "40", "--device", "cpu", "--no-share"]) == 1
    assert "disagree" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks", [2, 3])
def test_train_ddp_under_torchrun(tmp_path: Path, ranks: int) -> None:
    """DDP on gloo with the Loader's defaults: 103 records, batches of 17, two epochs.
    Every rank runs the same number of batches and finishes (unequal counts would leave
    one rank waiting in the gradient all-reduce until gloo's timeout)."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    root = EXAMPLES.parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
        str(EXAMPLES / "train_ddp.py"), "--workdir", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    per_rank = -(-103 // ranks)  # padded shards, as DistributedSampler
    batches = -(-per_rank // 17)  # 4 with 2 ranks, 3 with 3
    everyone = [[batches, batches]] * ranks
    for rank in range(ranks):
        mine = [line for line in lines if line.startswith(f"rank {rank}/{ranks}: ")]
        losses = []
        for epoch in (1, 2):
            (line,) = [x for x in mine if f": epoch {epoch}: " in x]
            assert f"{batches} batches, {per_rank} records" in line
            losses.append(float(re.sub(r".*loss ", "", line)))
        assert losses[1] < losses[0]
        assert mine[-1].endswith(
            f"finished 2 epochs; batches per epoch on ranks 0..{ranks - 1}: {everyone}"
        )


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_every_example_answers_help(name: str) -> None:
    # train_ddp.py with torch hidden, as on a machine without it: --help still works
    hide = "sys.modules['torch'] = None\n" if name == "train_ddp.py" else ""
    code = (
        "import runpy, sys\n"
        f"{hide}"
        "sys.argv = [sys.argv[1], '--help']\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(EXAMPLES / name)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: {name}"), proc.stdout


def test_examples_use_only_the_public_api() -> None:
    for path in EXAMPLES.glob("*.py"):
        private = re.findall(r"^\s*(?:from|import) blobpipe\._\w*", path.read_text(), re.M)
        assert private == [], (path.name, private)
