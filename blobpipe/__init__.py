"""blobpipe: Caffe's Blob, SyncedMemory and DataLayer for modern Python.

The modules, what each owns and what it may import: the table at the top of
``docs/design.md`` (held by ``tests/test_layers.py``).

Nothing here imports CuPy or decides on a device: backends are resolved on
first use (``device="auto"`` tries CUDA, then falls back to the host).
"""

from __future__ import annotations

from ._backends import Backend as Backend
from ._backends import get_backend as get_backend
from ._backends import set_default_backend as set_default_backend
from ._blob import Blob as Blob
from ._blobfile import read_blobproto as read_blobproto
from ._blobfile import read_caffemodel as read_caffemodel
from ._blobfile import write_blobproto as write_blobproto
from ._codec import load_mean_file as load_mean_file
from ._errors import ArgumentError as ArgumentError
from ._errors import ArgumentTypeError as ArgumentTypeError
from ._errors import BackendUnavailableError as BackendUnavailableError
from ._errors import BlobIndexError as BlobIndexError
from ._errors import BlobpipeError as BlobpipeError
from ._errors import DatabaseNotFoundError as DatabaseNotFoundError
from ._errors import DataError as DataError
from ._errors import DiskFullError as DiskFullError
from ._errors import FileMissingError as FileMissingError
from ._errors import MissingDependencyError as MissingDependencyError
from ._errors import OutputExistsError as OutputExistsError
from ._errors import PoolMemoryError as PoolMemoryError
from ._errors import ProtoError as ProtoError
from ._errors import RecordNotFoundError as RecordNotFoundError
from ._errors import ShapeError as ShapeError
from ._errors import StateError as StateError
from ._errors import UnsupportedOperationError as UnsupportedOperationError
from ._io._batches import ArrayBatch as ArrayBatch
from ._io._batches import Batches as Batches
from ._io._batches import BatchPlan as BatchPlan
from ._io._datum import datum_view as datum_view
from ._io._datum import decode_datum as decode_datum
from ._io._datum import decode_datum_into as decode_datum_into
from ._io._encode import encode_encoded_datum as encode_encoded_datum
from ._io._encode import encode_float_datum as encode_float_datum
from ._io._encode import encode_raw_datum as encode_raw_datum
from ._io._hdf5 import Hdf5Data as Hdf5Data
from ._io._image import jpeg_window_decoding as jpeg_window_decoding
from ._io._imagelist import ImageList as ImageList
from ._io._kernels import Geometry as Geometry
from ._io._kernels import compiled_row_kernel as compiled_row_kernel
from ._io._leveldb import LevelDbReader as LevelDbReader
from ._io._lmdb import LmdbReader as LmdbReader
from ._io._lmdb import ReadTransaction as ReadTransaction
from ._io._prototxt import DataLayerConfig as DataLayerConfig
from ._io._prototxt import read_data_layer as read_data_layer
from ._io._transform import RecordParams as RecordParams
from ._io._transform import Transform as Transform
from ._io._wire import ParsedDatum as ParsedDatum
from ._io._wire import parse_datum as parse_datum
from ._layout import nchw_offset as nchw_offset
from ._layout import nchw_to_nhwc as nchw_to_nhwc
from ._layout import nhwc_offset as nhwc_offset
from ._layout import nhwc_to_nchw as nhwc_to_nchw
from ._loader import Batch as Batch
from ._loader import Loader as Loader
from ._loader import LoaderStatistics as LoaderStatistics
from ._pool import MemoryPool as MemoryPool
from ._pool import PoolStatistics as PoolStatistics
from ._pool import get_pool as get_pool
from ._shape import MAX_BLOB_AXES as MAX_BLOB_AXES
from ._syncedmem import Head as Head
from ._syncedmem import SyncedMemory as SyncedMemory
from ._tools import BenchResult as BenchResult
from ._tools import ConvertResult as ConvertResult
from ._tools import DatabaseInfo as DatabaseInfo
from ._tools import ExportResult as ExportResult
from ._tools import MeanResult as MeanResult
from ._tools import SkippedImage as SkippedImage
from ._tools import bench as bench
from ._tools import compute_mean as compute_mean
from ._tools import convert_imageset as convert_imageset
from ._tools import export as export
from ._tools import inspect_db as inspect_db
from ._tools import read_list_file as read_list_file
from ._tools import write_lmdb as write_lmdb

__version__ = "0.1.0"
