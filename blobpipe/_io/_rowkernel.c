/* Caffe's DataTransformer over uint8 pixels, each record with its own crop
 * offset and flip, without the GIL.
 *
 * transform_rows(src, offsets, shape, h_off, w_off, mirror, mean, scale, out,
 *                crop, nhwc) -> None: a batch of raw records
 *
 * src      a buffer (read only) holding the rows; row i's (C, H, W) pixels are
 *          C*H*W bytes at offsets[i], C-contiguous.
 * offsets  int64 buffer, one per row.
 * shape    (C, H, W) of every row.
 * h_off, w_off   intp buffers: row i's crop corner; mirror: bool (uint8) buffer.
 * mean     None, a float32 buffer of C values (one per channel), or of C*H*W
 *          values (the uncropped mean file, C-contiguous (C, H, W)).
 * scale    the factor (a Python float, used as float32).
 * out      a writable C-contiguous buffer of n rows of C*crop*crop (crop: 0 is
 *          H and W), float32 (itemsize 4) or uint8 (itemsize 1: the pixels
 *          cropped and flipped, no arithmetic); or a tuple of such buffers, of
 *          one itemsize, each a whole number of rows, that take the n rows in
 *          order (consecutive batches, each in its own array).
 * nhwc     0: rows are (C, h, w); 1: (h, w, C).
 *
 * transform_image(src, hwc, shape, h_off, w_off, flip, mean, scale, out, crop,
 *                 nhwc) -> None: one record, e.g. a decoded image
 *
 * src      exactly the record's C*H*W pixels, C-contiguous as (C, H, W), or as
 *          (H, W, C) when hwc is true (a decoded image); the other arguments as
 *          above, for one row.
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
#include <stdlib.h>
#include <string.h>

/* The loops are compiled twice on x86-64 Linux (GCC, Clang): for any x86-64 and
 * for AVX2, chosen once at load time; the arithmetic is the same either way. */
#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#define CLONES __attribute__((noinline, target_clones("default", "avx2")))
#else
#define CLONES __attribute__((noinline))
#endif

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

/* One output line: the crop's cw pixels from s (pixel j at s[j * sstep]) and
 * the mean at the same positions (m: a mean file's line, mstep 1; one value,
 * mstep 0), written at o + j * ostep, forward or reversed (flip). Each case is
 * its own loop so that the compiler vectorizes the contiguous ones (sstep and
 * ostep 1); kept out of line (the vectorizer does not look at these loops
 * inlined into the caller). */
#define EACH(STORE)                                                                      \
    do {                                                                                 \
        if (has_mean && mstep) {                                                         \
            if (has_scale) {                                                             \
                for (ptrdiff_t j = 0; j < cw; j++) STORE(((float)s[S(j)] - m[K(j)]) * scale);  \
            } else {                                                                     \
                for (ptrdiff_t j = 0; j < cw; j++) STORE((float)s[S(j)] - m[K(j)]);            \
            }                                                                            \
        } else if (has_mean) {                                                           \
            const float mv = m[0];                                                       \
            if (has_scale) {                                                             \
                for (ptrdiff_t j = 0; j < cw; j++) STORE(((float)s[S(j)] - mv) * scale);       \
            } else {                                                                     \
                for (ptrdiff_t j = 0; j < cw; j++) STORE((float)s[S(j)] - mv);                 \
            }                                                                            \
        } else if (has_scale) {                                                          \
            for (ptrdiff_t j = 0; j < cw; j++) STORE((float)s[S(j)] * scale);                  \
        } else {                                                                         \
            for (ptrdiff_t j = 0; j < cw; j++) STORE((float)s[S(j)]);                          \
        }                                                                                \
    } while (0)

CLONES static void line_f32(float *restrict o, ptrdiff_t ostep,
                                               const uint8_t *restrict s, ptrdiff_t sstep,
                                               const float *restrict m, int mstep, float scale,
                                               ptrdiff_t cw, int flip, int has_mean,
                                               int has_scale) {
#define FORWARD(V) o[j] = (V)
#define STRIDED(V) o[j * ostep] = (V)
#define S(j) K(j)
    if (ostep == 1 && sstep == 1) {
        if (flip) {
#define K(j) (cw - 1 - (j))
            EACH(FORWARD);
#undef K
        } else {
#define K(j) (j)
            EACH(FORWARD);
#undef K
        }
        return;
    }
#undef S
#define S(j) (K(j) * sstep)
    if (flip) {
#define K(j) (cw - 1 - (j))
        EACH(STRIDED);
#undef K
    } else {
#define K(j) (j)
        EACH(STRIDED);
#undef K
    }
#undef S
#undef FORWARD
#undef STRIDED
}

CLONES static void line_u8(uint8_t *restrict o, ptrdiff_t ostep,
                                              const uint8_t *restrict s, ptrdiff_t sstep, ptrdiff_t cw,
                                              int flip) {
    if (!flip && ostep == 1 && sstep == 1) {
        memcpy(o, s, (size_t)cw);
        return;
    }
    for (ptrdiff_t j = 0; j < cw; j++) o[j * ostep] = s[(flip ? cw - 1 - j : j) * sstep];
}

/* One output line of each of three channels from (H, W, 3) pixels: the crop's cw
 * pixels at s (three bytes each), forward, into o0, o1, o2, with the mean at the
 * same positions (m0..m2: a mean file's lines, mstep 1; one value each, mstep 0).
 * The caller mirrors a line afterwards (reversed_copy from a scratch line). */
#define EACH3(E)                                                                         \
    do {                                                                                 \
        for (ptrdiff_t j = 0; j < cw; j++) {                                             \
            o0[j] = E(0, s[3 * j], j);                                                   \
            o1[j] = E(1, s[3 * j + 1], j);                                               \
            o2[j] = E(2, s[3 * j + 2], j);                                               \
        }                                                                                \
    } while (0)
#define MF_S(c, x, j) (((float)(x) - m##c[j]) * scale)
#define MF(c, x, j) ((float)(x) - m##c[j])
#define MV_S(c, x, j) (((float)(x) - v##c) * scale)
#define MV(c, x, j) ((float)(x) - v##c)
#define SC(c, x, j) ((float)(x) * scale)
#define NO(c, x, j) ((float)(x))

CLONES static void line3_f32(float *restrict o0, float *restrict o1, float *restrict o2,
                             const uint8_t *restrict s, const float *restrict m0,
                             const float *restrict m1, const float *restrict m2, int mstep,
                             float scale, ptrdiff_t cw, int has_mean, int has_scale) {
    if (has_mean && mstep) {
        if (has_scale)
            EACH3(MF_S);
        else
            EACH3(MF);
    } else if (has_mean) {
        const float v0 = m0[0], v1 = m1[0], v2 = m2[0];
        if (has_scale)
            EACH3(MV_S);
        else
            EACH3(MV);
    } else if (has_scale) {
        EACH3(SC);
    } else {
        EACH3(NO);
    }
}

CLONES static void reversed_copy(float *restrict o, const float *restrict t, ptrdiff_t n) {
    for (ptrdiff_t j = 0; j < n; j++) o[j] = t[n - 1 - j];
}

static void reverse_f32(float *o, ptrdiff_t n) {
    for (ptrdiff_t i = 0, j = n - 1; i < j; i++, j--) {
        const float t = o[i];
        o[i] = o[j];
        o[j] = t;
    }
}

typedef struct {
    Py_ssize_t C, H, W, ch, cw; /* record shape, crop window */
    int hwc;                    /* source pixels (H, W, C) rather than (C, H, W) */
    int nhwc;                   /* output rows (h, w, C) rather than (C, h, w) */
    const float *mean;          /* NULL, C values, or C*H*W (a mean file) */
    int mstep;                  /* 1: a mean file */
    float scale;
    int itemsize; /* of the output: 4 float32, 1 uint8 */
} Spec;

/* One record (s0: its first pixel) into one output row (o), crop corner (h0, w0);
 * every index was checked by the caller. Runs without the GIL. */
static void transform_one(const Spec *sp, const uint8_t *s0, Py_ssize_t h0, Py_ssize_t w0,
                          int flip, void *o) {
    const Py_ssize_t C = sp->C, H = sp->H, W = sp->W, ch = sp->ch, cw = sp->cw;
    const ptrdiff_t sstep = sp->hwc ? (ptrdiff_t)C : 1;
    const ptrdiff_t ostep = sp->nhwc ? (ptrdiff_t)C : 1;
    if (!flip && !sp->hwc && !sp->nhwc && cw == W) {
        /* whole lines of (C, H, W) into (C, h, W): a channel's lines are one run
         * in the source, the mean file and the output */
        for (Py_ssize_t c = 0; c < C; c++) {
            const Py_ssize_t at = (c * H + h0) * W;
            const Py_ssize_t o_at = c * ch * cw;
            if (sp->itemsize == 1) {
                memcpy((uint8_t *)o + o_at, s0 + at, (size_t)(ch * cw));
            } else {
                const float *m = sp->mean ? (sp->mstep ? sp->mean + at : sp->mean + c) : NULL;
                line_f32((float *)o + o_at, 1, s0 + at, 1, m, sp->mstep, sp->scale,
                         ch * cw, 0, sp->mean != NULL, sp->scale != 1.0f);
            }
        }
        return;
    }
    if (sp->hwc && C == 3 && !sp->nhwc && sp->itemsize == 4) {
        /* a decoded colour image into (3, h, w): one pass over each source line */
        float *const out = (float *)o;
        /* a mirrored line goes through a scratch line, then is copied reversed
         * (in place, scalar, where the scratch cannot be had) */
        float *scratch = flip ? malloc((size_t)(3 * cw) * sizeof(float)) : NULL;
        for (Py_ssize_t y = 0; y < ch; y++) {
            const uint8_t *s = s0 + ((h0 + y) * W + w0) * 3;
            float *o0 = out + y * cw, *o1 = out + (ch + y) * cw, *o2 = out + (2 * ch + y) * cw;
            const float *m0 = NULL, *m1 = NULL, *m2 = NULL;
            if (sp->mean) {
                const Py_ssize_t at = (h0 + y) * W + w0; /* channel 0's, (C, H, W) */
                m0 = sp->mstep ? sp->mean + at : sp->mean;
                m1 = sp->mstep ? sp->mean + H * W + at : sp->mean + 1;
                m2 = sp->mstep ? sp->mean + 2 * H * W + at : sp->mean + 2;
            }
            if (scratch) {
                line3_f32(scratch, scratch + cw, scratch + 2 * cw, s, m0, m1, m2, sp->mstep,
                          sp->scale, cw, sp->mean != NULL, sp->scale != 1.0f);
                reversed_copy(o0, scratch, cw);
                reversed_copy(o1, scratch + cw, cw);
                reversed_copy(o2, scratch + 2 * cw, cw);
                continue;
            }
            line3_f32(o0, o1, o2, s, m0, m1, m2, sp->mstep, sp->scale, cw, sp->mean != NULL,
                      sp->scale != 1.0f);
            if (flip) {
                reverse_f32(o0, cw);
                reverse_f32(o1, cw);
                reverse_f32(o2, cw);
            }
        }
        free(scratch);
        return;
    }
    for (Py_ssize_t c = 0; c < C; c++) {
        for (Py_ssize_t y = 0; y < ch; y++) {
            const Py_ssize_t at = (c * H + h0 + y) * W + w0; /* uncropped, (C, H, W) */
            const uint8_t *s = s0 + (sp->hwc ? ((h0 + y) * W + w0) * C + c : at);
            /* output: NCHW (c, y, 0); NHWC (y, 0, c) */
            const Py_ssize_t o_at = sp->nhwc ? (y * cw) * C + c : (c * ch + y) * cw;
            if (sp->itemsize == 1) {
                line_u8((uint8_t *)o + o_at, ostep, s, sstep, cw, flip);
            } else {
                const float *m = sp->mean ? (sp->mstep ? sp->mean + at : sp->mean + c) : NULL;
                line_f32((float *)o + o_at, ostep, s, sstep, m, sp->mstep, sp->scale, cw,
                         flip, sp->mean != NULL, sp->scale != 1.0f);
            }
        }
    }
}

/* The spec from the arguments both entry points share; -1 with an exception set. */
static int make_spec(Spec *sp, Py_ssize_t C, Py_ssize_t H, Py_ssize_t W, Py_ssize_t crop,
                     int hwc, int nhwc, Buf *mb, double scale, Buf *ob, Py_ssize_t rows) {
    if (C <= 0 || H <= 0 || W <= 0 || crop < 0 || crop > H || crop > W) {
        PyErr_SetString(PyExc_ValueError, "bad shape or crop");
        return -1;
    }
    sp->C = C, sp->H = H, sp->W = W;
    sp->ch = crop ? crop : H, sp->cw = crop ? crop : W;
    sp->hwc = hwc, sp->nhwc = nhwc;
    sp->itemsize = (int)ob->view.itemsize;
    if ((sp->itemsize != 4 && sp->itemsize != 1) ||
        ob->view.len != rows * C * sp->ch * sp->cw * sp->itemsize) {
        PyErr_SetString(PyExc_ValueError, "out must hold n rows of float32 or uint8");
        return -1;
    }
    sp->mean = NULL;
    sp->mstep = 0;
    if (mb->held) {
        if (mb->view.itemsize != 4 || (mb->view.len != C * 4 && mb->view.len != C * H * W * 4)) {
            PyErr_SetString(PyExc_ValueError, "mean must be C or C*H*W float32 values");
            return -1;
        }
        sp->mean = (const float *)mb->view.buf;
        sp->mstep = mb->view.len == C * H * W * 4;
    }
    sp->scale = (float)scale;
    return 0;
}

static int crop_fits(const Spec *sp, Py_ssize_t h0, Py_ssize_t w0, Py_ssize_t i) {
    if (h0 < 0 || w0 < 0 || h0 > sp->H - sp->ch || w0 > sp->W - sp->cw) {
        PyErr_Format(PyExc_ValueError, "row %zd's crop does not fit", i);
        return 0;
    }
    return 1;
}

static PyObject *transform_rows(PyObject *self, PyObject *args) {
    PyObject *src_o, *off_o, *h_o, *w_o, *flip_o, *mean_o, *out_o;
    Py_ssize_t C, H, W, crop;
    double scale;
    int nhwc;
    if (!PyArg_ParseTuple(args, "OO(nnn)OOOOdOni", &src_o, &off_o, &C, &H, &W, &h_o, &w_o,
                          &flip_o, &mean_o, &scale, &out_o, &crop, &nhwc))
        return NULL;
    Buf src = {0}, off = {0}, hb = {0}, wb = {0}, fb = {0}, mb = {0};
    PyObject *result = NULL;
    Spec sp;
    const Py_ssize_t nout = PyTuple_Check(out_o) ? PyTuple_GET_SIZE(out_o) : 1;
    Buf *obs = PyMem_Calloc(nout > 0 ? (size_t)nout : 1, sizeof(Buf));
    if (obs == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    if (get_buf(src_o, &src, PyBUF_SIMPLE, "src") || get_buf(off_o, &off, PyBUF_FORMAT, "offsets") ||
        get_buf(h_o, &hb, PyBUF_FORMAT, "h_off") || get_buf(w_o, &wb, PyBUF_FORMAT, "w_off") ||
        get_buf(flip_o, &fb, PyBUF_SIMPLE, "mirror") ||
        (mean_o != Py_None && get_buf(mean_o, &mb, PyBUF_FORMAT, "mean")))
        goto done;
    if (nout < 1) {
        PyErr_SetString(PyExc_ValueError, "out must hold n rows of float32 or uint8");
        goto done;
    }
    for (Py_ssize_t k = 0; k < nout; k++) {
        PyObject *item = PyTuple_Check(out_o) ? PyTuple_GET_ITEM(out_o, k) : out_o;
        if (get_buf(item, &obs[k], PyBUF_WRITABLE | PyBUF_FORMAT, "out")) goto done;
    }
    Py_ssize_t n = off.view.len / 8;
    if (off.view.itemsize != 8 || hb.view.itemsize != (Py_ssize_t)sizeof(Py_ssize_t) ||
        wb.view.itemsize != (Py_ssize_t)sizeof(Py_ssize_t) || hb.view.len / hb.view.itemsize != n ||
        wb.view.len / wb.view.itemsize != n || fb.view.len != n) {
        PyErr_SetString(PyExc_ValueError, "offsets, h_off, w_off and mirror must be one per row");
        goto done;
    }
    /* the outputs together, as one buffer of n rows (checked by make_spec) */
    Buf all = obs[0];
    all.view.len = 0;
    for (Py_ssize_t k = 0; k < nout; k++) {
        if (obs[k].view.itemsize != obs[0].view.itemsize) {
            PyErr_SetString(PyExc_ValueError, "out must hold n rows of float32 or uint8");
            goto done;
        }
        all.view.len += obs[k].view.len;
    }
    if (make_spec(&sp, C, H, W, crop, 0, nhwc, &mb, scale, &all, n) < 0) goto done;
    const Py_ssize_t row_bytes = C * sp.ch * sp.cw * sp.itemsize;
    for (Py_ssize_t k = 0; k < nout; k++) {
        if (obs[k].view.len % row_bytes != 0) {
            PyErr_SetString(PyExc_ValueError, "each out must hold a whole number of rows");
            goto done;
        }
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
        if (!crop_fits(&sp, hs[i], ws[i], i)) goto done;
    }
    const uint8_t *base = (const uint8_t *)src.view.buf;
    Py_BEGIN_ALLOW_THREADS;
    Py_ssize_t k = 0, left = obs[0].view.len;
    uint8_t *dst = (uint8_t *)obs[0].view.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        while (left == 0) { /* the next output (the lengths add up to n rows) */
            k++;
            dst = (uint8_t *)obs[k].view.buf;
            left = obs[k].view.len;
        }
        transform_one(&sp, base + offsets[i], hs[i], ws[i], flips[i] != 0, dst);
        dst += row_bytes;
        left -= row_bytes;
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
    for (Py_ssize_t k = 0; k < nout; k++) release(&obs[k]);
    PyMem_Free(obs);
    return result;
}

static PyObject *transform_image(PyObject *self, PyObject *args) {
    PyObject *src_o, *mean_o, *out_o;
    Py_ssize_t C, H, W, h0, w0, crop;
    int hwc, flip, nhwc;
    double scale;
    if (!PyArg_ParseTuple(args, "Oi(nnn)nnpOdOni", &src_o, &hwc, &C, &H, &W, &h0, &w0, &flip,
                          &mean_o, &scale, &out_o, &crop, &nhwc))
        return NULL;
    Buf src = {0}, mb = {0}, ob = {0};
    PyObject *result = NULL;
    Spec sp;
    if (get_buf(src_o, &src, PyBUF_SIMPLE, "src") ||
        (mean_o != Py_None && get_buf(mean_o, &mb, PyBUF_FORMAT, "mean")) ||
        get_buf(out_o, &ob, PyBUF_WRITABLE | PyBUF_FORMAT, "out"))
        goto done;
    if (make_spec(&sp, C, H, W, crop, hwc, nhwc, &mb, scale, &ob, 1) < 0) goto done;
    if (src.view.len != C * H * W) {
        PyErr_SetString(PyExc_ValueError, "src must hold the image's C*H*W pixels");
        goto done;
    }
    if (!crop_fits(&sp, h0, w0, 0)) goto done;
    Py_BEGIN_ALLOW_THREADS;
    transform_one(&sp, (const uint8_t *)src.view.buf, h0, w0, flip, ob.view.buf);
    Py_END_ALLOW_THREADS;
    Py_INCREF(Py_None);
    result = Py_None;
done:
    release(&src);
    release(&mb);
    release(&ob);
    return result;
}

static PyMethodDef methods[] = {
    {"transform_rows", transform_rows, METH_VARARGS,
     "Caffe's transform of raw (C, H, W) uint8 rows of one buffer (see the module source)."},
    {"transform_image", transform_image, METH_VARARGS,
     "Caffe's transform of one uint8 image, (C, H, W) or (H, W, C) (see the module source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rowkernel", NULL, -1, methods};

PyMODINIT_FUNC PyInit__rowkernel(void) { return PyModule_Create(&module); }
