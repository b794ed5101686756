"""The blocking form's event loop: ``with Loader(...)`` runs the loader's
``async with`` in a blocking portal's thread until :meth:`Portal.close`.

The fillers run under that loop; ``for batch in loader`` takes batches in the
calling thread (the hand-off is thread-safe), with no round trip through the
loop.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Any

import anyio
import anyio.abc
import anyio.from_thread

__all__ = ["Portal"]


class Portal:
    """Holds ``async with target`` open in a portal's event loop thread.

    Returns once ``target`` was entered; an error entering it is raised here
    and the portal is shut down.
    """

    def __init__(self, target: AbstractAsyncContextManager[Any]) -> None:
        self._close_requested: anyio.Event | None = None
        self._cm = anyio.from_thread.start_blocking_portal()
        self._portal = self._cm.__enter__()
        try:
            self._future, _ = self._portal.start_task(self._host, target)
        except BaseException:
            self._cm.__exit__(None, None, None)
            raise

    async def _host(
        self,
        target: AbstractAsyncContextManager[Any],
        *,
        task_status: anyio.abc.TaskStatus[None],
    ) -> None:
        self._close_requested = anyio.Event()
        async with target:
            task_status.started()
            await self._close_requested.wait()

    def close(self) -> None:
        """Leave ``async with target`` (raising what it raised) and stop the portal."""
        try:
            if self._close_requested is not None:
                self._portal.call(self._close_requested.set)
            self._future.result()
        finally:
            self._cm.__exit__(None, None, None)
