"""The host backend: no CUDA. Host buffers are ordinary memory; no device."""

from __future__ import annotations

from ._base import Backend

__all__ = ["HostBackend"]


class HostBackend(Backend):
    """Everything stays on the CPU; device accessors raise BackendUnavailableError."""

    name = "host"
    has_device = False
    pinned = False
