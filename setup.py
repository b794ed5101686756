"""The one compiled part, beside pyproject.toml (which holds everything else).

Decoding only a JPEG crop's window (libjpeg-turbo's partial decompression,
``blobpipe/_io/_jpegwindow.c``) is built where libjpeg-turbo's headers are present
(Debian/Ubuntu: libjpeg62-turbo-dev or libjpeg-turbo8-dev; Fedora: libjpeg-turbo-devel).
Elsewhere the build skips it (``optional``) and images are decoded whole with OpenCV:
the same pixels.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "blobpipe._io._jpegwindow",
            sources=["blobpipe/_io/_jpegwindow.c"],
            libraries=["jpeg"],
            optional=True,
        )
    ]
)
