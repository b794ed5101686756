"""The release wheel carries its decoders' libraries (``scripts/build_wheel.sh``).

The script builds the wheel and repairs it with auditwheel (libjpeg-turbo and libpng
copied into ``blobpipe.libs/``). The repaired wheel is installed into a fresh virtual
environment and imported where the system's libjpeg and libpng cannot be loaded: a
private mount namespace in which an empty file is bound over every copy of them the
dynamic loader could find. There the compiled JPEG and PNG decoders must load and
decode, to OpenCV's pixels. The control: the same wheel before its repair, in the same
hidden environment, loads neither (so the hiding hides). Slow (about a minute: a build
and a fresh environment's dependencies from pip).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "build_wheel.sh"
# the sonames blobpipe's decoders link, and the file names of every copy of them
SONAMES = ("libjpeg.so.62", "libpng16.so.16")
PATTERNS = ("libjpeg.so*", "libpng16.so*", "libpng.so*")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="auditwheel: Linux wheels"),
]

# Run in the fresh environment, hidden: argv[1:] are the system files that must not load.
PROBE = textwrap.dedent(
    """
    import ctypes, json, sys

    def loads(name):
        try:
            ctypes.CDLL(name)
        except OSError as exc:
            return str(exc)
        return None

    result = {"not_loaded": {n: loads(n) for n in [*SONAMES, *sys.argv[1:]]}}
    import blobpipe
    from blobpipe._io import _image

    result["file"] = blobpipe.__file__
    result["jpeg"] = blobpipe.jpeg_window_decoding()
    result["png"] = _image._compiled("_pngrows") is not None
    for name in ("_jpegwindow", "_pngrows"):
        try:
            __import__("blobpipe._io." + name)
        except ImportError as exc:
            result[name + "_error"] = str(exc)

    import cv2
    import numpy as np

    y, x = np.mgrid[0:48, 0:64]
    noise = np.random.default_rng(0).integers(0, 40, (48, 64, 3))
    pixels = ((np.stack([x * 3, y * 5, x + 2 * y], -1) + noise) % 256).astype(np.uint8)
    zero = np.zeros(1, np.intp)
    for ext, name in ((".jpg", "_jpegwindow"), (".png", "_pngrows")):
        decoder = getattr(_image, name)
        if decoder is None:
            continue
        data = cv2.imencode(ext, pixels)[1].tobytes()
        out = np.full((1, 3, 48, 64), -1, np.float32)
        status = decoder.decode_rows(
            [data], (3, 48, 64), zero, zero, np.zeros(1, np.bool_), None, 1.0, out, 0, 0
        )
        want = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
        result[ext] = bool(status[0]) and np.array_equal(out[0], want.transpose(2, 0, 1))
    with open("/proc/self/maps") as maps:
        result["mapped"] = sorted(
            {line.split()[-1] for line in maps if "jpeg" in line or "png" in line}
        )
    print(json.dumps(result))
    """
).replace("SONAMES", repr(SONAMES))


def system_copies() -> list[str]:
    """Every file the dynamic loader could take libjpeg or libpng from here: the
    library directories' (and their multiarch subdirectories') and the loader cache's."""
    found: set[Path] = set()
    for top in ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib"):
        for d in [Path(top), *Path(top).glob("*-linux-gnu*")]:
            for pattern in PATTERNS:
                found.update(d.glob(pattern))
    ldconfig = shutil.which("ldconfig") or next(
        (p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.path.exists(p)), None
    )
    if ldconfig:
        cache = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, check=False)
        for line in cache.stdout.splitlines():
            name, _, path = line.strip().partition(" => ")
            if name.startswith(("libjpeg.so", "libpng")) and path:
                found.add(Path(path))
    return sorted({str(p.resolve()) for p in found if p.resolve().is_file()})


def hiding_command(tmp: Path, files: list[str]) -> tuple[list[str] | None, str]:
    """The command prefix that runs a command with an empty file bound over each of
    ``files`` in a private mount namespace (as root; else in a user namespace), and
    why there is none where neither can be made here."""
    empty = tmp / "empty"
    empty.touch()
    bind = (
        'empty=$1; shift; while [ "$1" != -- ]; do mount --bind "$empty" "$1" || exit 97; '
        'shift; done; shift; exec "$@"'
    )
    tries = [["--user", "--map-root-user"]] if os.geteuid() else [[], ["--user", "--map-root-user"]]
    why = []
    if not shutil.which("unshare"):
        return None, "no unshare (util-linux) to make a mount namespace"
    for extra in tries:
        prefix = ["unshare", *extra, "--mount", "--propagation", "private"]
        prefix += ["sh", "-c", bind, "sh", str(empty), *files, "--"]
        trial = subprocess.run([*prefix, "true"], capture_output=True, text=True, check=False)
        if trial.returncode == 0:
            return prefix, ""
        why.append(f"unshare {' '.join(extra)} --mount: {trial.stderr.strip()}")
    return None, "cannot bind-mount over the system libraries here: " + "; ".join(why)


@dataclass
class Env:
    python: Path
    repaired: Path
    unrepaired: Path
    tmp: Path


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """The two wheels (built by the script) and a fresh environment with the repaired one
    installed, its dependencies from pip (about 300 MB, removed afterwards)."""
    tmp = tmp_path_factory.mktemp("wheel")
    out = tmp / "out"
    build = subprocess.run(
        ["bash", str(SCRIPT), "--keep-unrepaired", str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable},
        check=False,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (repaired,) = out.glob("blobpipe-*-manylinux_*.whl")
    (unrepaired,) = (out / "unrepaired").glob("blobpipe-*-linux_*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", str(repaired)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    yield Env(python, repaired, unrepaired, tmp)
    shutil.rmtree(tmp, ignore_errors=True)


def probe(env: Env, hidden: list[str], prefix: list[str], path: Path | None) -> dict[str, Any]:
    """The probe's findings, run in the fresh environment (blobpipe from ``path`` where
    given) from outside the checkout, under ``prefix``."""
    script = env.tmp / "probe.py"
    script.write_text(PROBE)
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "LD_LIBRARY_PATH", "LD_PRELOAD")
    }
    if path is not None:
        clean["PYTHONPATH"] = str(path)
    run = subprocess.run(
        [*prefix, str(env.python), str(script), *hidden],
        capture_output=True,
        text=True,
        cwd=env.tmp,
        env=clean,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    found: dict[str, Any] = json.loads(run.stdout.splitlines()[-1])
    return found


def hidden_or_skip(env: Env) -> tuple[list[str], list[str]]:
    hidden = system_copies()
    prefix, why = hiding_command(env.tmp, hidden)
    if prefix is None:
        pytest.skip(why)
    return hidden, prefix


def test_the_repaired_wheels_decoders_need_only_its_own_libraries(env: Env) -> None:
    """Without a namespace: every libjpeg and libpng the installed decoders name is a
    file of the wheel's, found through their RPATH."""
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("no readelf (binutils)")
    site = next((env.python.parent.parent / "lib").glob("python3*/site-packages"))
    for name in ("_jpegwindow", "_pngrows"):
        (so,) = (site / "blobpipe" / "_io").glob(f"{name}.*.so")
        dynamic = subprocess.run([readelf, "-d", str(so)], capture_output=True, text=True)
        needed = [
            line.rsplit("[", 1)[1].rstrip("]")
            for line in dynamic.stdout.splitlines()
            if "(NEEDED)" in line
        ]
        ours = [n for n in needed if n.startswith(("libjpeg", "libpng"))]
        assert len(ours) == 1, needed
        assert (site / "blobpipe.libs" / ours[0]).is_file(), ours
        assert "$ORIGIN/../../blobpipe.libs" in dynamic.stdout, dynamic.stdout


def test_the_repaired_wheel_decodes_without_the_systems_libraries(env: Env) -> None:
    hidden, prefix = hidden_or_skip(env)
    found = probe(env, hidden, prefix, None)
    assert all(found["not_loaded"].values()), found["not_loaded"]  # hidden indeed
    assert Path(found["file"]).is_relative_to(env.python.parent.parent), found["file"]
    assert found["jpeg"] is True, found
    assert found["png"] is True, found
    assert found[".jpg"] is True and found[".png"] is True, found  # OpenCV's pixels
    libs = env.python.parent.parent.resolve()
    ours = [m for m in found["mapped"] if "/blobpipe.libs/" in m]
    assert {Path(m).name.split("-")[0] for m in ours} == {"libjpeg", "libpng16"}, found
    assert all(Path(m).resolve().is_relative_to(libs) for m in ours), found
    assert not set(found["mapped"]) & set(hidden), found


def test_the_unrepaired_wheel_falls_back_there(env: Env) -> None:
    """The control: the wheel as built, before auditwheel, under the same hiding, loads
    neither decoder (blobpipe falls back to OpenCV); with the libraries visible, both."""
    hidden, prefix = hidden_or_skip(env)
    target = env.tmp / "unrepaired"
    subprocess.run(
        [str(env.python), "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
         str(env.unrepaired)],
        capture_output=True,
        check=True,
    )  # fmt: skip
    found = probe(env, hidden, prefix, target)
    assert Path(found["file"]).is_relative_to(target), found["file"]
    assert all(found["not_loaded"].values()), found["not_loaded"]
    assert found["jpeg"] is False and found["png"] is False, found
    assert "libjpeg.so.62" in found["_jpegwindow_error"], found
    assert "libpng16.so.16" in found["_pngrows_error"], found
    visible = probe(env, [], [], target)
    assert visible["jpeg"] is True and visible["png"] is True, visible
