/* A batch's PNGs decoded by libpng and transformed in one call, without the GIL.
 *
 * decode_rows(images, shape, h_off, w_off, mirror, mean, scale, out, crop, nhwc
 *             [, sizes[, extents]]) -> bytes
 *
 * The arguments are those of _jpegwindow.c's decode_rows: row i's image (a
 * buffer, or None to leave the row alone; or its extent of one buffer) of the
 * batch's shape (3, H, W), or of its own size sizes[i], is decoded whole into the
 * call's one scratch (the largest row's H_i*W_i*3 bytes) as BGR rows and
 * transformed into its output row by the shared kernel (_kernel.h), crop corner
 * (h_off[i], w_off[i]), flip mirror[i]. Returns one byte per row: 1 where the row
 * was written, 0 where it was left to the caller.
 *
 * Only what OpenCV's cv2.imdecode (libpng underneath) gives the same pixels for
 * is decoded here: an 8-bit RGB PNG (colour type 2), not interlaced, of exactly
 * its row's H × W, with no tRNS chunk (OpenCV may add an alpha channel from it) and no
 * eXIf chunk (OpenCV may turn the image by its orientation). Every libpng error
 * or warning (a CRC that does not match, data after the image, a chunk cut short)
 * leaves the row to the caller, which decodes it with OpenCV and reports what
 * OpenCV says. The size is read from the IHDR chunk and checked against its row's (H, W)
 * before any pixel is decoded; an ancillary chunk may not ask libpng for more
 * than CHUNK_MAX bytes.
 *
 * Built where libpng's headers are present (an optional extension).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_kernel.h"

#include <png.h>
#include <setjmp.h>

#define CHUNK_MAX (1 << 20)

typedef struct {
    const unsigned char *data;
    size_t size, at;
    int warnings;
} Source;

static void read_bytes(png_structp png, png_bytep out, size_t len) {
    Source *src = (Source *)png_get_io_ptr(png);
    if (len > src->size - src->at) png_error(png, "the image is cut short");
    memcpy(out, src->data + src->at, len);
    src->at += len;
}

static void on_error(png_structp png, png_const_charp msg) {
    (void)msg;
    png_longjmp(png, 1);
}

static void on_warning(png_structp png, png_const_charp msg) {
    (void)msg;
    ((Source *)png_get_error_ptr(png))->warnings++;
}

/* 1: the whole image as (H, W, 3) BGR rows in out; 0: left (see the top). */
static int decode(const unsigned char *data, size_t size, unsigned char *out, long H, long W,
                  png_bytep *rows) {
    if (size < 8 || png_sig_cmp(data, 0, 8) != 0) return 0;
    Source src = {data, size, 0, 0};
    png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &src, on_error, on_warning);
    if (png == NULL) return 0;
    /* made before setjmp and never assigned after it: destroyed whatever longjmps */
    png_infop info = png_create_info_struct(png), end = png_create_info_struct(png);
    volatile int ok = 0;
    if (info == NULL || end == NULL) goto done;
    if (setjmp(png_jmpbuf(png))) goto done;
    png_set_chunk_malloc_max(png, CHUNK_MAX);
    png_set_read_fn(png, &src, read_bytes);
    png_read_info(png, info);
    png_uint_32 w = 0, h = 0;
    int depth = 0, colour = 0, interlace = 0;
    png_get_IHDR(png, info, &w, &h, &depth, &colour, &interlace, NULL, NULL);
    if ((long)w != W || (long)h != H || depth != 8 || colour != PNG_COLOR_TYPE_RGB ||
        interlace != PNG_INTERLACE_NONE)
        goto done;
    if (png_get_valid(png, info, PNG_INFO_tRNS)) goto done;
#ifdef PNG_INFO_eXIf
    if (png_get_valid(png, info, PNG_INFO_eXIf)) goto done;
#endif
    png_set_bgr(png);
    png_read_update_info(png, info);
    if (png_get_rowbytes(png, info) != (size_t)W * 3 || png_get_channels(png, info) != 3) goto done;
    for (long y = 0; y < H; y++) rows[y] = out + (size_t)y * (size_t)W * 3;
    png_read_image(png, rows);
    png_read_end(png, end);
#ifdef PNG_INFO_eXIf
    if (png_get_valid(png, end, PNG_INFO_eXIf)) goto done;
#endif
    ok = src.warnings == 0;
done:
    png_destroy_read_struct(&png, &info, &end);
    return ok;
}

static PyObject *decode_rows(PyObject *self, PyObject *args) {
    (void)self;
    Rows r;
    if (rows_from_args(&r, args) < 0) return NULL;
    const Py_ssize_t most = r.max_h > 0 ? r.max_h : 1; /* the tallest row's lines */
    png_bytep *lines = (size_t)most <= PY_SSIZE_T_MAX / sizeof(png_bytep)
                           ? PyMem_RawMalloc((size_t)most * sizeof(png_bytep))
                           : NULL;
    if (lines == NULL) {
        PyErr_NoMemory();
        Py_XDECREF(close_rows(&r));
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS;
    FREE_BEGIN
    for (Py_ssize_t i = 0; i < r.n; i++) {
        if (r.im.p[i] == NULL) continue;
        Py_ssize_t H, W; /* checked by open_rows: the scratch and the lines hold it */
        row_size(&r, i, &H, &W);
        if (decode(r.im.p[i], (size_t)r.im.len[i], r.scratch, (long)H, (long)W,
                   lines))
            row_done(&r, i);
    }
    free_scratch(&r);
    FREE_END
    Py_END_ALLOW_THREADS;
    PyMem_RawFree(lines);
    return close_rows(&r);
}

static PyMethodDef methods[] = {
    {"decode_rows", decode_rows, METH_VARARGS,
     "decode_rows(images, shape, h_off, w_off, mirror, mean, scale, out, crop, nhwc[, sizes"
     "[, extents]]) -> bytes: a batch's 8-bit RGB PNGs decoded and transformed into their "
     "output rows in one call without the GIL; 1 per row done, 0 per row left to the "
     "caller. sizes: (n, 2) intp, each row's own (height, width), else every row's is the "
     "shape's; extents: as _jpegwindow.decode_rows's."},
    IMAGE_SIZES_METHOD,
    FREE_CPU_METHOD,
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_pngrows",
    .m_doc = "A batch's PNGs decoded by libpng and transformed in one call.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__pngrows(void) { return PyModule_Create(&module); }
