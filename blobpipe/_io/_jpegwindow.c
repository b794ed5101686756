/* Decoding a JPEG with libjpeg-turbo: a window alone (partial decompression), or
 * the whole image straight into a caller's buffer.
 *
 * decode_window(data, out, top, left, height, width) -> bool
 *
 * `out` is a writable C-contiguous uint8 buffer holding the whole image as
 * (image height, image width, 3) BGR rows; the window's pixels are written,
 * and those of the margin decoded around it (below), the rest left alone: each
 * line is read straight to its place in `out` (no line buffer, no copy: the copy
 * took a tenth of W4's CPU). The columns outside the decoded window are never
 * converted (jpeg_crop_scanline), the rows above it are skipped without colour
 * conversion (jpeg_skip_scanlines) and the rows below it are not decoded.
 *
 * The window is decoded with a margin (MARGIN pixels each side, clamped to the
 * image) that is then dropped, so the chroma upsampling of every kept pixel
 * sees the same neighbours as in a full decode (the margin's own pixels are
 * written but not exact); the caller checks exactness against OpenCV's full
 * decode.
 *
 * decode_whole(data, out, max_pixels) -> (status, height, width)
 *
 * The whole image as (height, width, 3) BGR rows into the first height*width*3
 * bytes of `out`, several rows a call, no copy: status 1. Status 2: the image
 * (height × width, at most max_pixels) needs a larger `out`; nothing is written,
 * the caller grows it and calls again. Status 0: as False below. The size is
 * read from the frame header and checked against max_pixels before anything
 * is allocated or written.
 *
 * decode_rows(images, shape, h_off, w_off, mirror, mean, scale, out, crop, nhwc
 *             [, sizes[, extents]]) -> bytes
 *
 * A batch's JPEGs of one shape (C, H, W) = (3, H, W), or with `sizes` (an (n, 2)
 * intp array, or None) each of its own size (H_i, W_i) = sizes[i] (a crop that fits
 * each, or every size the batch's: _kernel.h's check_sizes): row i's image (a
 * buffer, or None to leave the row alone; with `extents`, an (n, 2) int64 array,
 * `images` is one buffer and row i's image its bytes at extents[i] = (offset,
 * length), offset -1 to leave the row alone) decoded, only the window of its crop (h_off[i],
 * w_off[i], crop, crop) where there is a crop, and transformed into its output
 * row by the shared kernel (_kernel.h: mirror, mean, scale, layout; the other
 * arguments as _rowkernel.c's transform_rows); one call, the GIL released once.
 * Returns one byte per row: 1 where the row was written, 0 where it was left to
 * the caller (None, an image of another size than its row's, or refused as
 * below). The one scratch image is the largest row's H_i*W_i*3 bytes, every size
 * checked before the GIL is released (the caller bounds them by its pixel limit).
 *
 * image_sizes(images[, extents]) -> bytes: each image's format and size from its
 * header (_kernel.h's header_size), for drawing the crops before decode_rows.
 *
 * All three leave alone (False, status 0), having written nothing the caller may use,
 * whenever the result might differ from OpenCV's cv2.imdecode of the whole image
 * (followed by the same crop): bytes that do not
 * end with the EOI marker (a truncated file: its damage may lie below the
 * window, where this decode never looks), not a 3-component YCbCr JPEG of 8-bit
 * samples, an image of another size than `out` says, an EXIF orientation other
 * than 1, any libjpeg warning (damaged data) or error.
 * The caller then decodes the whole image with OpenCV. Memory is bounded by the
 * image's size, which is checked against a pixel limit before any call decodes.
 *
 * The GIL is released while libjpeg runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_kernel.h"

#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>

#define MARGIN 16

#if !defined(JCS_EXTENSIONS)
#error "libjpeg-turbo's colour-space extensions (JCS_EXT_BGR) are needed"
#endif

struct window_error {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
};

static void window_error_exit(j_common_ptr cinfo) {
    struct window_error *err = (struct window_error *)cinfo->err;
    longjmp(err->jump, 1);
}

static void window_emit_message(j_common_ptr cinfo, int msg_level) {
    /* a warning (level -1) marks damaged data: counted, never printed */
    if (msg_level < 0) cinfo->err->num_warnings++;
}

static void window_output_message(j_common_ptr cinfo) { (void)cinfo; }

/* The EXIF orientation in an APP1 marker: 1 when there is none, 0 when it cannot
 * be read. */
static unsigned exif_orientation(const JOCTET *p, unsigned len) {
    if (len < 14 || memcmp(p, "Exif\0\0", 6) != 0) return 1;
    p += 6;
    len -= 6;
    int little;
    if (p[0] == 'I' && p[1] == 'I') little = 1;
    else if (p[0] == 'M' && p[1] == 'M') little = 0;
    else return 0;
#define U16(q) (little ? (unsigned)((q)[0] | ((q)[1] << 8)) : (unsigned)(((q)[0] << 8) | (q)[1]))
#define U32(q) (little ? ((unsigned long)(q)[0] | ((unsigned long)(q)[1] << 8) | \
                          ((unsigned long)(q)[2] << 16) | ((unsigned long)(q)[3] << 24)) \
                       : (((unsigned long)(q)[0] << 24) | ((unsigned long)(q)[1] << 16) | \
                          ((unsigned long)(q)[2] << 8) | (unsigned long)(q)[3]))
    unsigned long ifd = U32(p + 4);
    if (ifd > len || len - ifd < 2) return 0;
    unsigned count = U16(p + ifd);
    if ((len - ifd - 2) / 12 < count) return 0;
    for (unsigned i = 0; i < count; i++) {
        const JOCTET *e = p + ifd + 2 + 12 * i;
        if (U16(e) == 0x0112) return U16(e + 2) == 3 ? U16(e + 8) : 0;
    }
    return 1;
#undef U16
#undef U32
}

/* Rows read per jpeg_read_scanlines call of a whole-image decode. */
#define ROWS_PER_READ 16

/* 1: written; 0: not exact or not possible (see the top of the file); 2: (whole
 * images) `out` is too small for the image, whose size is in *size_h, *size_w.
 * `whole`: decode the whole image (the window arguments are ignored) if it has at
 * most max_pixels pixels. want_h, want_w (0: any): refuse an image of another size
 * before decoding it. */
static int decode(const unsigned char *data, size_t size, unsigned char *out,
                  Py_ssize_t out_len, long top, long left, long height, long width,
                  int whole, long long max_pixels, long *size_h, long *size_w, long want_h,
                  long want_w) {
    struct jpeg_decompress_struct cinfo;
    struct window_error err;
    volatile int ok = 0;

    memset(&cinfo, 0, sizeof(cinfo));
    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = window_error_exit;
    err.pub.emit_message = window_emit_message;
    err.pub.output_message = window_output_message;
    if (size < 4 || data[size - 2] != 0xFF || data[size - 1] != 0xD9) return 0;
    if (setjmp(err.jump)) goto done;
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, data, (unsigned long)size);
    jpeg_save_markers(&cinfo, JPEG_APP0 + 1, 0xFFFF);
    if (jpeg_read_header(&cinfo, TRUE) != JPEG_HEADER_OK) goto done;
    if (cinfo.num_components != 3 || cinfo.jpeg_color_space != JCS_YCbCr ||
        cinfo.data_precision != 8)
        goto done;
    for (jpeg_saved_marker_ptr m = cinfo.marker_list; m != NULL; m = m->next)
        if (m->marker == JPEG_APP0 + 1 && exif_orientation(m->data, m->data_length) != 1)
            goto done;
    long image_w = (long)cinfo.image_width, image_h = (long)cinfo.image_height;
    *size_h = image_h;
    *size_w = image_w;
    if (want_h && (image_h != want_h || image_w != want_w)) goto done;
    if (whole) {
        if (image_w <= 0 || image_h <= 0 || (long long)image_w * image_h > max_pixels) goto done;
        if ((long long)image_w * image_h * 3 > (long long)out_len) {
            ok = 2;
            goto done;
        }
        cinfo.out_color_space = JCS_EXT_BGR;
        jpeg_start_decompress(&cinfo);
        if (cinfo.output_components != 3 || (long)cinfo.output_width != image_w ||
            (long)cinfo.output_height != image_h)
            goto done;
        size_t stride = (size_t)image_w * 3;
        while (cinfo.output_scanline < cinfo.output_height) {
            JSAMPROW rows[ROWS_PER_READ];
            JDIMENSION at = cinfo.output_scanline, k = 0;
            for (; k < ROWS_PER_READ && at + k < cinfo.output_height; k++)
                rows[k] = out + (size_t)(at + k) * stride;
            if (jpeg_read_scanlines(&cinfo, rows, k) == 0) goto done;
        }
        ok = err.pub.num_warnings == 0;
        goto done;
    }
    if ((Py_ssize_t)image_w * image_h * 3 != out_len) goto done;
    /* compared without a sum that could overflow (the window is the caller's) */
    if (top < 0 || left < 0 || height <= 0 || width <= 0 || top > image_h || left > image_w ||
        height > image_h - top || width > image_w - left)
        goto done;
    cinfo.out_color_space = JCS_EXT_BGR;
    jpeg_start_decompress(&cinfo);
    if (cinfo.output_components != 3 || (long)cinfo.output_width != image_w) goto done;

    long x0 = left > MARGIN ? left - MARGIN : 0;
    long x1 = left + width + MARGIN < image_w ? left + width + MARGIN : image_w;
    JDIMENSION xoff = (JDIMENSION)x0, cw = (JDIMENSION)(x1 - x0);
    if (x0 > 0 || x1 < image_w) jpeg_crop_scanline(&cinfo, &xoff, &cw);
    if ((long)xoff > left || (long)(xoff + cw) < left + width) goto done;
    /* the decoded columns [xoff, xoff + output_width) lie inside the image: each line
     * is read straight to its place in `out` (no line buffer, no copy), the window's
     * pixels and those of the margin around it */
    if ((long)xoff + (long)cinfo.output_width > image_w) goto done;
    long y0 = top > MARGIN ? top - MARGIN : 0;
    if (y0 > 0 && jpeg_skip_scanlines(&cinfo, (JDIMENSION)y0) != (JDIMENSION)y0) goto done;
    size_t stride = (size_t)image_w * 3;
    unsigned char *first = out + (size_t)xoff * 3;
    while ((long)cinfo.output_scanline < top + height) {
        JSAMPROW rows[ROWS_PER_READ];
        JDIMENSION at = cinfo.output_scanline, k = 0;
        for (; k < ROWS_PER_READ && (long)(at + k) < top + height; k++)
            rows[k] = first + (size_t)(at + k) * stride;
        if (jpeg_read_scanlines(&cinfo, rows, k) == 0) goto done;
    }
    ok = err.pub.num_warnings == 0;
done:
    jpeg_destroy_decompress(&cinfo);
    return ok;
}

static PyObject *decode_window(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer data, out;
    long top, left, height, width;
    if (!PyArg_ParseTuple(args, "y*w*llll", &data, &out, &top, &left, &height, &width))
        return NULL;
    int ok = 0;
    long h = 0, w = 0;
    if (PyBuffer_IsContiguous(&out, 'C')) {
        Py_BEGIN_ALLOW_THREADS
        FREE_BEGIN
        ok = decode(data.buf, (size_t)data.len, out.buf, out.len, top, left, height, width, 0,
                    0, &h, &w, 0, 0);
        FREE_END
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    return PyBool_FromLong(ok == 1);
}

static PyObject *decode_whole(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer data, out;
    long long max_pixels;
    if (!PyArg_ParseTuple(args, "y*w*L", &data, &out, &max_pixels)) return NULL;
    int status = 0;
    long h = 0, w = 0;
    if (PyBuffer_IsContiguous(&out, 'C')) {
        Py_BEGIN_ALLOW_THREADS
        FREE_BEGIN
        status = decode(data.buf, (size_t)data.len, out.buf, out.len, 0, 0, 0, 0, 1, max_pixels,
                        &h, &w, 0, 0);
        FREE_END
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    return Py_BuildValue("(ill)", status, status ? h : 0L, status ? w : 0L);
}


static PyObject *decode_rows(PyObject *self, PyObject *args) {
    (void)self;
    Rows r;
    if (rows_from_args(&r, args) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS;
    FREE_BEGIN
    for (Py_ssize_t i = 0; i < r.n; i++) {
        if (r.im.p[i] == NULL) continue;
        Py_ssize_t H, W; /* checked by open_rows: H*W*3 fits, the scratch holds it */
        row_size(&r, i, &H, &W);
        const int whole = r.sp.ch == H && r.sp.cw == W;
        long h = 0, w = 0;
        if (decode(r.im.p[i], (size_t)r.im.len[i], r.scratch, H * W * 3,
                   (long)r.hs[i], (long)r.ws[i], (long)r.sp.ch, (long)r.sp.cw, whole,
                   (long long)H * W, &h, &w, (long)H, (long)W) == 1)
            row_done(&r, i);
    }
    free_scratch(&r);
    FREE_END
    Py_END_ALLOW_THREADS;
    return close_rows(&r);
}

static PyMethodDef methods[] = {
    {"decode_window", decode_window, METH_VARARGS,
     "decode_window(data, out, top, left, height, width) -> bool: a window of a JPEG "
     "into out (the whole image's BGR rows); False where it might differ from a full "
     "decode."},
    {"decode_whole", decode_whole, METH_VARARGS,
     "decode_whole(data, out, max_pixels) -> (status, height, width): the whole JPEG into "
     "out's first height*width*3 bytes (1), out too small for it (2), or refused where it "
     "might differ from OpenCV's decode or has more than max_pixels pixels (0)."},
    {"decode_rows", decode_rows, METH_VARARGS,
     "decode_rows(images, shape, h_off, w_off, mirror, mean, scale, out, crop, nhwc[, sizes"
     "[, extents]]) -> bytes: a batch's JPEGs decoded (a crop's window alone) and "
     "transformed into their output rows in one call without the GIL; 1 per row done, 0 "
     "per row left to the caller. sizes: "
     "(n, 2) intp, each row's own (height, width), else every row's is the shape's; "
     "extents: (n, 2) int64, row i's image at images[offset:offset + length] (offset -1: "
     "none), images one buffer."},
    IMAGE_SIZES_METHOD,
    FREE_CPU_METHOD,
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_jpegwindow",
    .m_doc = "A window of a JPEG, decoded with libjpeg-turbo's partial decompression.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__jpegwindow(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "LIBJPEG_TURBO_VERSION_NUMBER",
#ifdef LIBJPEG_TURBO_VERSION_NUMBER
                                             LIBJPEG_TURBO_VERSION_NUMBER
#else
                                             0
#endif
                                             ) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
