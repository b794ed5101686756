"""Dataset tools: Caffe's convert_imageset and compute_image_mean, inspect, export, bench.

The top layer next to the CLI: it uses the io layer (records, transforms,
batches) and nothing imports it but :mod:`blobpipe` and :mod:`blobpipe._cli`.
"""

from __future__ import annotations

from .._errors import OutputExistsError
from ._bench import BenchResult, bench
from ._convert import ConvertResult, SkippedImage, convert_imageset, read_list_file
from ._export import ExportResult, export
from ._inspect import DatabaseInfo, inspect_db
from ._mean import MeanResult, compute_mean
from ._progress import Progress
from ._write import write_lmdb

__all__ = [
    "BenchResult",
    "ConvertResult",
    "DatabaseInfo",
    "ExportResult",
    "MeanResult",
    "OutputExistsError",
    "Progress",
    "SkippedImage",
    "bench",
    "compute_mean",
    "convert_imageset",
    "export",
    "inspect_db",
    "read_list_file",
    "write_lmdb",
]
