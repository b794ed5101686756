/* Caffe's DataTransformer over raw uint8 rows of one buffer, each row with its
 * own crop offset and flip, in one call that releases the GIL.
 *
 * transform_rows(src, offsets, shape, h_off, w_off, mirror, mean, scale, out,
 *                crop, nhwc) -> None
 *
 * src      a buffer (read only) holding the rows; row i's (C, H, W) pixels are
 *          C*H*W bytes at offsets[i], C-contiguous.
 * offsets  int64 buffer, one per row.
 * shape    (C, H, W) of every row.
 * h_off, w_off   intp buffers: row i's crop corner; mirror: bool (uint8) buffer.
 * mean     None, a float32 buffer of C values (one per channel), or of C*H*W
 *          values (the uncropped mean file, C-contiguous).
 * scale    the factor (a Python float, used as float32).
 * out      a writable C-contiguous buffer of n rows of C*crop*crop (crop: 0 is
 *          H and W), float32 (itemsize 4) or uint8 (itemsize 1: the pixels
 *          cropped and flipped, no arithmetic).
 * nhwc     0: rows are (C, h, w); 1: (h, w, C).
 *
 * The arithmetic is Caffe's, in float32, each step rounded:
 * (float)x - mean at the pixel's uncropped position, then * scale; without a
 * mean (float)x * scale; with scale 1 the product is skipped (x * 1 == x).
 * Mirroring reverses each output row: out column j takes the crop's column
 * (w - 1 - j), pixel and mean alike.
 *
 * Every offset, crop corner and size is checked against the buffers before the
 * GIL is released (ValueError naming the row): no read or write outside them.
 * Built with -ffp-contract=off: no fused multiply-add changes a rounding.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    Py_buffer view;
    int held;
} Buf;

static int get_buf(PyObject *obj, Buf *b, int flags, const char *name) {
    if (PyObject_GetBuffer(obj, &b->view, flags) != 0) {
        PyErr_Format(PyExc_TypeError, "%s must support the buffer protocol (%s)", name,
                     (flags & PyBUF_WRITABLE) ? "writable, C-contiguous" : "C-contiguous");
        return -1;
    }
    b->held = 1;
    return 0;
}

static void release(Buf *b) {
    if (b->held) {
        PyBuffer_Release(&b->view);
        b->held = 0;
    }
}

/* One output row: the crop's cw pixels from s (stride 1 along the width) and
 * the mean at the same positions (m: a mean file's row, mstep 1; one value,
 * mstep 0), written forward at o + j * ostep, or reversed (flip). Each case is
 * its own loop so that the compiler vectorizes the contiguous ones; kept out of
 * line (the vectorizer does not look at these loops inlined into the caller). */
#define EACH(STORE)                                                                  \
    do {                                                                             \
        if (has_mean && mstep) {                                                     \
            if (has_scale) {                                                         \
                for (int j = 0; j < cw; j++) STORE(((float)s[K(j)] - m[K(j)]) * scale);  \
            } else {                                                                 \
                for (int j = 0; j < cw; j++) STORE((float)s[K(j)] - m[K(j)]);           \
            }                                                                        \
        } else if (has_mean) {                                                       \
            const float mv = m[0];                                                   \
            if (has_scale) {                                                         \
                for (int j = 0; j < cw; j++) STORE(((float)s[K(j)] - mv) * scale);      \
            } else {                                                                 \
                for (int j = 0; j < cw; j++) STORE((float)s[K(j)] - mv);                \
            }                                                                        \
        } else if (has_scale) {                                                      \
            for (int j = 0; j < cw; j++) STORE((float)s[K(j)] * scale);                 \
        } else {                                                                     \
            for (int j = 0; j < cw; j++) STORE((float)s[K(j)]);                         \
        }                                                                            \
    } while (0)

__attribute__((noinline)) static void row_f32(float *restrict o, ptrdiff_t ostep,
                                              const uint8_t *restrict s,
                                              const float *restrict m, int mstep, float scale,
                                              int cw, int flip, int has_mean, int has_scale) {
#define FORWARD(V) o[j] = (V)
#define STRIDED(V) o[j * ostep] = (V)
    if (ostep == 1) {
        if (flip) {
#define K(j) (cw - 1 - (j))
            EACH(FORWARD);
#undef K
        } else {
#define K(j) (j)
            EACH(FORWARD);
#undef K
        }
    } else if (flip) {
#define K(j) (cw - 1 - (j))
        EACH(STRIDED);
#undef K
    } else {
#define K(j) (j)
        EACH(STRIDED);
#undef K
    }
#undef FORWARD
#undef STRIDED
}

__attribute__((noinline)) static void row_u8(uint8_t *restrict o, ptrdiff_t ostep,
                                             const uint8_t *restrict s, int cw, int flip) {
    if (!flip && ostep == 1) {
        memcpy(o, s, (size_t)cw);
        return;
    }
    for (int j = 0; j < cw; j++) o[j * ostep] = s[flip ? cw - 1 - j : j];
}

static PyObject *transform_rows(PyObject *self, PyObject *args) {
    PyObject *src_o, *off_o, *h_o, *w_o, *flip_o, *mean_o, *out_o;
    Py_ssize_t C, H, W, crop;
    double scale_d;
    int nhwc;
    if (!PyArg_ParseTuple(args, "OO(nnn)OOOOdOni", &src_o, &off_o, &C, &H, &W, &h_o, &w_o,
                          &flip_o, &mean_o, &scale_d, &out_o, &crop, &nhwc))
        return NULL;
    Buf src = {0}, off = {0}, hb = {0}, wb = {0}, fb = {0}, mb = {0}, ob = {0};
    PyObject *result = NULL;
    if (get_buf(src_o, &src, PyBUF_SIMPLE, "src") || get_buf(off_o, &off, PyBUF_FORMAT, "offsets") ||
        get_buf(h_o, &hb, PyBUF_FORMAT, "h_off") || get_buf(w_o, &wb, PyBUF_FORMAT, "w_off") ||
        get_buf(flip_o, &fb, PyBUF_SIMPLE, "mirror") ||
        (mean_o != Py_None && get_buf(mean_o, &mb, PyBUF_FORMAT, "mean")) ||
        get_buf(out_o, &ob, PyBUF_WRITABLE | PyBUF_FORMAT, "out"))
        goto done;
    if (C <= 0 || H <= 0 || W <= 0 || crop < 0 || crop > H || crop > W) {
        PyErr_SetString(PyExc_ValueError, "bad shape or crop");
        goto done;
    }
    Py_ssize_t n = off.view.len / 8;
    if (off.view.itemsize != 8 || hb.view.itemsize != (Py_ssize_t)sizeof(Py_ssize_t) ||
        wb.view.itemsize != (Py_ssize_t)sizeof(Py_ssize_t) || hb.view.len / hb.view.itemsize != n ||
        wb.view.len / wb.view.itemsize != n || fb.view.len != n) {
        PyErr_SetString(PyExc_ValueError, "offsets, h_off, w_off and mirror must be one per row");
        goto done;
    }
    const Py_ssize_t ch = crop ? crop : H, cw = crop ? crop : W;
    const Py_ssize_t row_px = C * ch * cw;
    const int itemsize = (int)ob.view.itemsize;
    if ((itemsize != 4 && itemsize != 1) || ob.view.len != n * row_px * itemsize) {
        PyErr_SetString(PyExc_ValueError, "out must hold n rows of float32 or uint8");
        goto done;
    }
    const float *mean = NULL;
    int mstep = 0; /* 1: a mean file (C, H, W); 0: one value per channel */
    if (mb.held) {
        if (mb.view.itemsize != 4 || (mb.view.len != C * 4 && mb.view.len != C * H * W * 4)) {
            PyErr_SetString(PyExc_ValueError, "mean must be C or C*H*W float32 values");
            goto done;
        }
        mean = (const float *)mb.view.buf;
        mstep = mb.view.len == C * H * W * 4;
    }
    const int64_t *offsets = (const int64_t *)off.view.buf;
    const Py_ssize_t *hs = (const Py_ssize_t *)hb.view.buf, *ws = (const Py_ssize_t *)wb.view.buf;
    const uint8_t *flips = (const uint8_t *)fb.view.buf;
    const Py_ssize_t size = C * H * W;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (offsets[i] < 0 || offsets[i] > src.view.len - size) {
            PyErr_Format(PyExc_ValueError, "row %zd lies outside the buffer", i);
            goto done;
        }
        if (hs[i] < 0 || ws[i] < 0 || hs[i] > H - ch || ws[i] > W - cw) {
            PyErr_Format(PyExc_ValueError, "row %zd's crop does not fit", i);
            goto done;
        }
    }
    const float scale = (float)scale_d;
    const int has_scale = scale != 1.0f;
    const uint8_t *base = (const uint8_t *)src.view.buf;
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *s0 = base + offsets[i];
        const Py_ssize_t h0 = hs[i], w0 = ws[i];
        const int flip = flips[i] != 0;
        for (Py_ssize_t c = 0; c < C; c++) {
            for (Py_ssize_t y = 0; y < ch; y++) {
                const Py_ssize_t at = (c * H + h0 + y) * W + w0; /* uncropped position */
                const uint8_t *s = s0 + at;
                /* output: NCHW (c, y, 0) step 1; NHWC (y, 0, c) step C */
                Py_ssize_t o_at = nhwc ? (y * cw) * C + c : (c * ch + y) * cw;
                ptrdiff_t ostep = nhwc ? (ptrdiff_t)C : 1;
                if (itemsize == 1) {
                    row_u8((uint8_t *)ob.view.buf + i * row_px + o_at, ostep, s, (int)cw, flip);
                } else {
                    const float *m = mean ? (mstep ? mean + at : mean + c) : NULL;
                    row_f32((float *)ob.view.buf + i * row_px + o_at, ostep, s, m, mstep, scale,
                            (int)cw, flip, mean != NULL, has_scale);
                }
            }
        }
    }
    Py_END_ALLOW_THREADS;
    Py_INCREF(Py_None);
    result = Py_None;
done:
    release(&src);
    release(&off);
    release(&hb);
    release(&wb);
    release(&fb);
    release(&mb);
    release(&ob);
    return result;
}

static PyMethodDef methods[] = {
    {"transform_rows", transform_rows, METH_VARARGS,
     "Caffe's transform of raw uint8 rows of one buffer (see the module source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rowkernel", NULL, -1, methods};

PyMODINIT_FUNC PyInit__rowkernel(void) { return PyModule_Create(&module); }
