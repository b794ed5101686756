"""The compiled parts, beside pyproject.toml (which holds everything else). Both are
optional: where one does not build, NumPy or OpenCV does the same work, to the same bits.

Caffe's transform of raw rows (``blobpipe/_io/_rowkernel.c``: crop, mirror, mean, scale
and layout, each row with its own crop, in one call without the GIL) needs only a C
compiler.

Decoding a batch's JPEGs with libjpeg-turbo (only a crop's window where there is a crop:
partial decompression) and transforming them in one call (``blobpipe/_io/_jpegwindow.c``,
with the row kernel of ``_kernel.h``) is built where libjpeg-turbo's headers are present
(Debian/Ubuntu: libjpeg62-turbo-dev or libjpeg-turbo8-dev; Fedora: libjpeg-turbo-devel).
Elsewhere the build skips it (``optional``) and images are decoded whole with OpenCV:
the same pixels. Decoding a batch's 8-bit RGB PNGs with libpng in one call
(``blobpipe/_io/_pngrows.c``) likewise needs libpng's headers (Debian/Ubuntu: libpng-dev;
Fedora: libpng-devel).

``scripts/build_wheel.sh`` builds the release wheel, refuses one without either decoder, and
repairs it with auditwheel: libjpeg-turbo and libpng are copied into it (``blobpipe.libs/``),
so its decoders load where neither library nor its headers are installed.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "blobpipe._io._jpegwindow",
            sources=["blobpipe/_io/_jpegwindow.c"],
            depends=["blobpipe/_io/_kernel.h"],
            libraries=["jpeg"],
            # the shared row kernel: no fused multiply-add (see below)
            extra_compile_args=["-O3", "-ffp-contract=off"],
            optional=True,
        ),
        Extension(
            "blobpipe._io._pngrows",
            sources=["blobpipe/_io/_pngrows.c"],
            depends=["blobpipe/_io/_kernel.h"],
            libraries=["png"],
            extra_compile_args=["-O3", "-ffp-contract=off"],
            optional=True,
        ),
        Extension(
            "blobpipe._io._rowkernel",
            sources=["blobpipe/_io/_rowkernel.c"],
            depends=["blobpipe/_io/_kernel.h"],
            # no fused multiply-add: every step rounds to float32 as Caffe's does
            extra_compile_args=["-O3", "-ffp-contract=off"],
            optional=True,
        ),
    ]
)
