"""This process's id, without a system call.

The loader checks it on every batch (a batch's lease, the consumer's ``next``) to
refuse or skip work in a forked child. ``os.getpid()`` is a system call, and a
system call made while holding the GIL is a point where the kernel may deschedule
the thread with the GIL held, stalling every other thread (the loader made two a
batch; ``tests/test_pid.py`` holds it to none). The id is read once and
again in each child that ``os.fork`` makes (also ``multiprocessing``'s fork
start method); a fork that runs no Python fork hooks leaves an interpreter that
cannot run threads anyway.
"""

from __future__ import annotations

import os

__all__ = ["pid"]

_pid = os.getpid()


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


def pid() -> int:
    """This process's id (``os.getpid()``, kept up to date across forks)."""
    return _pid
