"""Fresh memory in a first epoch, and the part of its cost a virtual machine's host adds.

A first epoch touches its buffers for the first time, and the kernel zeroes each page
then (transparent huge pages: one 2 MiB block a fault, about 0.1 ms a MiB on the
development VM). On a virtual machine whose balloon reports free memory to its host
(virtio-balloon's free page reporting, ``/sys/module/page_reporting``: free 2 MiB blocks
are handed back a few seconds after they are freed), a block the guest hands back costs
a fault on the host as well when it is touched again: 1–2 ms a MiB on the development
VM, 10–20 times the guest's own zeroing. Whether a process's fresh memory is such
blocks depends on how long ago earlier processes freed theirs, so on such a machine a
first epoch's time varies with the gap between runs, and the more fresh memory a
contender touches (a Loader's ring: five batches; the plain loop: one) the more.

:func:`prefault` touches ``mib`` MiB of huge pages and unmaps them, before a child's
clock starts: the maps made after it take those blocks, backed on the host again, so
the first epoch then pays the zeroing a machine without such a balloon pays, and its
figure says what fresh memory cost at that moment. Imports nothing of the project (the
first-epoch children import it from any checkout).

``python bench/_fresh.py [--mib 40] [--rounds 6] [--gap 3]`` shows it: fresh processes,
each touching ``--mib`` MiB of huge pages, started back to back and ``--gap`` seconds
apart, then with a prefault of twice that before the touch (ms a MiB, per process).
"""

from __future__ import annotations

import argparse
import mmap
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["add_option", "note", "page_reporting", "prefault"]

_HUGE = 2 << 20
_PAGE = 4096
_REPORTING = Path("/sys/module/page_reporting/parameters/page_reporting_order")


def prefault(mib: int) -> float:
    """Touch ``mib`` MiB of fresh anonymous memory (advised to be huge pages, as the
    Loader's host buffers are) and unmap it; return the milliseconds a MiB took."""
    if mib <= 0:
        return 0.0
    nbytes = mib << 20
    t0 = time.perf_counter()
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            region.madvise(advice)
        except OSError:  # a kernel without transparent huge pages
            pass
    for offset in range(0, nbytes, _PAGE):
        region[offset] = 1
    seconds = time.perf_counter() - t0
    region.close()
    return seconds * 1e3 / mib


def page_reporting() -> str | None:
    """A note for a benchmark's header where the kernel reports free pages to a
    hypervisor (the blocks' size), else None."""
    try:
        order = int(_REPORTING.read_text().strip())
    except (OSError, ValueError):
        return None
    return f"free page reporting to the host on ({(_PAGE << order) >> 20} MiB blocks)"


def add_option(ap: argparse.ArgumentParser) -> None:
    """``--prefault MIB`` (``args.prefault``, default 0) for a benchmark whose first
    epochs run in fresh processes."""
    ap.add_argument(
        "--prefault",
        type=int,
        default=0,
        metavar="MIB",
        help="each first epoch's process touches and unmaps MIB MiB of huge pages before "
        "its clock (a VM host's faults out of the fresh memory's cost; bench/_fresh.py)",
    )


def note(mib: int) -> str:
    """What a benchmark's header says of fresh memory: the prefault, free page reporting."""
    parts = [f"{mib} MiB prefaulted before each first epoch's clock"] if mib > 0 else []
    if (reporting := page_reporting()) is not None:
        parts.append(reporting)
    return "; ".join(parts)


def _child(mib: int, pre: int) -> float:
    if pre:
        prefault(pre)
    return prefault(mib)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="What fresh huge pages cost a fresh process.")
    ap.add_argument("--mib", type=int, default=40, help="MiB each process touches (40)")
    ap.add_argument("--rounds", type=int, default=6, help="processes per row (6)")
    ap.add_argument("--gap", type=float, default=3.0, help="seconds between processes (3)")
    args = ap.parse_args(argv)
    if args.mib < 1 or args.rounds < 1 or args.gap < 0:
        ap.error("--mib and --rounds must be >= 1, --gap >= 0")
    here = str(Path(__file__).resolve().parent)
    print(page_reporting() or "no free page reporting to a host")
    rows = (
        ("back to back", 0.0, 0),
        (f"{args.gap:g} s apart", args.gap, 0),
        (f"{args.gap:g} s apart, {2 * args.mib} MiB prefaulted", args.gap, 2 * args.mib),
    )
    for label, gap, pre in rows:
        got = []
        for _ in range(args.rounds):
            time.sleep(gap)
            code = f"import sys; sys.path.insert(0, {here!r}); import _fresh; "
            code += f"print(_fresh._child({args.mib}, {pre}))"
            out = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, check=True
            )
            got.append(float(out.stdout))
        got.sort()
        print(
            f"{args.mib} MiB touched, {label}: ms a MiB, median {got[len(got) // 2]:.3f} "
            f"(" + ", ".join(f"{g:.3f}" for g in got) + ")"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
