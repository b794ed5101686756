"""blobpipe: Caffe's Blob, SyncedMemory and DataLayer for modern Python.

Layers, each importing only those before it:
errors → device backends → memory (pool, SyncedMemory) → Blob → io (protobuf
codec, LMDB reader, transforms) → loader → CLI.
"""

from __future__ import annotations

from ._backends import Backend as Backend
from ._backends import get_backend as get_backend
from ._backends import set_default_backend as set_default_backend
from ._errors import BackendUnavailableError as BackendUnavailableError
from ._errors import BlobIndexError as BlobIndexError
from ._errors import BlobpipeError as BlobpipeError
from ._errors import DatabaseNotFoundError as DatabaseNotFoundError
from ._errors import DataError as DataError
from ._errors import PoolMemoryError as PoolMemoryError
from ._errors import ProtoError as ProtoError
from ._errors import ShapeError as ShapeError
from ._errors import StateError as StateError
from ._errors import UnsupportedOperationError as UnsupportedOperationError

__version__ = "0.1.0"
