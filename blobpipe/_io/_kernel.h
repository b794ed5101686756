/* Caffe's DataTransformer over uint8 pixels, one record into one output row with
 * its own crop offset and flip (transform_one, run without the GIL), and the
 * argument checks around it; the arguments and state of a batch of encoded images
 * decoded into their rows (Rows: each image of the batch's size, or of its own); and
 * the size each image's header announces (header_size, image_sizes). Included by the
 * compiled modules that transform rows: _rowkernel.c (raw records, one image),
 * _jpegwindow.c (JPEGs) and _pngrows.c (PNGs); _rowkernel.c's top comment states the
 * arithmetic and the arguments. Every
 * includer is built with -ffp-contract=off: no fused multiply-add changes a
 * rounding.
 */
#ifndef BLOBPIPE_KERNEL_H
#define BLOBPIPE_KERNEL_H

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

/* Acquire obj's buffer, with its format, shape and strides (flags may add
 * PyBUF_WRITABLE); -1 with a TypeError where obj has none (or not writable), a
 * ValueError where it is not C-contiguous. */
static int get_buf(PyObject *obj, Buf *b, int flags, const char *name) {
    if (PyObject_GetBuffer(obj, &b->view, flags | PyBUF_FORMAT | PyBUF_STRIDES) != 0) {
        PyErr_Format(PyExc_TypeError, "%s must support the buffer protocol (%s), got %.100s",
                     name, (flags & PyBUF_WRITABLE) ? "writable, C-contiguous" : "C-contiguous",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    b->held = 1;
    if (!PyBuffer_IsContiguous(&b->view, 'C')) {
        PyErr_Format(PyExc_ValueError, "%s must be C-contiguous (its items one after another)",
                     name);
        return -1;
    }
    return 0;
}

/* The kind of a buffer's items: 'i' signed integer, 'u' unsigned integer, 'f' float,
 * '?' bool, 'c' char, in this machine's byte order; 0 for any other format (several
 * fields, another byte order, a pointer...). A NULL format means unsigned bytes. */
static char item_kind(const Py_buffer *v) {
    const char *f = v->format ? v->format : "B";
    if (*f == '@' || *f == '=') {
        f++;
    } else if (*f == '<' || *f == '>' || *f == '!') {
#if PY_LITTLE_ENDIAN
        if (*f != '<') return 0;
#else
        if (*f == '<') return 0;
#endif
        f++;
    }
    if (f[0] == 0 || f[1] != 0) return 0;
    switch (f[0]) {
        case 'b': case 'h': case 'i': case 'l': case 'q': case 'n': return 'i';
        case 'B': case 'H': case 'I': case 'L': case 'Q': case 'N': return 'u';
        case 'e': case 'f': case 'd': return 'f';
        case '?': return '?';
        case 'c': return 'c';
        default: return 0;
    }
}

/* 1 where b's items are of one of the kinds in `kinds` (item_kind's letters) and
 * `itemsize` bytes; else 0 with a ValueError naming the buffer, what it must be and
 * what it is. */
static int items_are(const Buf *b, const char *kinds, Py_ssize_t itemsize, const char *name,
                     const char *expected) {
    const char kind = item_kind(&b->view);
    if (kind != 0 && strchr(kinds, kind) != NULL && b->view.itemsize == itemsize) return 1;
    PyErr_Format(PyExc_ValueError, "%s must be %s, got items of format '%s' (%zd bytes)", name,
                 expected, b->view.format ? b->view.format : "B", b->view.itemsize);
    return 0;
}

/* *out = a * b where it fits a Py_ssize_t (a, b >= 0): 1; else 0. */
static int mul_fits(Py_ssize_t a, Py_ssize_t b, Py_ssize_t *out) {
    if (a < 0 || b < 0 || (a != 0 && b > PY_SSIZE_T_MAX / a)) return 0;
    *out = a * b;
    return 1;
}

static void release(Buf *b) {
    if (b->held) {
        PyBuffer_Release(&b->view);
        b->held = 0;
    }
}

/* o[j] = t[n - 1 - j]: a line copied reversed. */
CLONES static void reversed_copy(float *restrict o, const float *restrict t, ptrdiff_t n) {
    for (ptrdiff_t j = 0; j < n; j++) o[j] = t[n - 1 - j];
}

/* Orders a thread's non-temporal stores (lines_f32's, where streamed) before what it
 * writes next: a job's fence before it is marked done. */
#if defined(__x86_64__)
#include <xmmintrin.h>
#define STREAM_FENCE() _mm_sfence()
#else
#define STREAM_FENCE() ((void)0)
#endif

/* The widest line line_f32 mirrors through a forward line on its stack. */
#define FLIP_LINE 1024

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
        if (flip && has_mean && mstep && cw <= FLIP_LINE) {
            /* a mean file's line reversed as well as the pixels' does not vectorize
             * (2-3x the time of a forward line): the line forward into t, then
             * copied reversed; each value computed as the loop below computes it */
            float t[FLIP_LINE];
#define K(j) (j)
#define SCRATCH(V) t[j] = (V)
            EACH(SCRATCH);
#undef SCRATCH
#undef K
            for (ptrdiff_t j = 0; j < cw; j++) o[j] = t[cw - 1 - j];
            return;
        }
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

/* Eight pixels at a time in GCC's and Clang's vector types: a line's blocks of 8,
 * forward or (mirrored) reversed, then the rest pixel by pixel. The compiler's own
 * vector loop takes 32 pixels a step: a shorter line (a 24- or 28-pixel crop), or
 * the rest of a line, went pixel by pixel. Each value is computed as the scalar loop
 * computes it: ((float)pixel - mean) * scale, where a missing mean subtracts 0 and a
 * missing scale multiplies by 1 (both exact). Elsewhere (or built with
 * -DBLOBPIPE_NO_VEC8) lines_f32 calls line_f32 a line. */
#if (defined(__GNUC__) || defined(__clang__)) && !defined(BLOBPIPE_NO_VEC8)
#define VEC8 1
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
/* the same, unaligned and aliasing anything (loads from a record's bytes, a mean) */
typedef float f32x8_u __attribute__((vector_size(32), aligned(1), may_alias));
/* (macros, not functions: a vector argument or return value of a function
 * compiled for any x86-64 has another ABI than the AVX2 clone's) */
#define PIXELS8(p)                                                                       \
    __builtin_convertvector(                                                             \
        ((i32x8){(p)[0], (p)[1], (p)[2], (p)[3], (p)[4], (p)[5], (p)[6], (p)[7]}), f32x8)
#define FLOATS8(p) ((f32x8)(*(const f32x8_u *)(p)))
#if defined(__clang__)
#define REVERSED8(v) __builtin_shufflevector((v), (v), 7, 6, 5, 4, 3, 2, 1, 0)
#else
#define REVERSED8(v) __builtin_shuffle((v), (i32x8){7, 6, 5, 4, 3, 2, 1, 0})
#endif
/* Block J's 8 output pixels of line y (lines_f32's contiguous case, below); a
 * mirrored line's from its source's pixels cw - 8 - J on, reversed. */
/* 8 floats at p (32-byte aligned) around the caches where NT (non-temporal stores,
 * x86-64's movntps, ordered by the caller's STREAM_FENCE), else stored as usual. */
#if defined(__x86_64__)
typedef float f32x4 __attribute__((vector_size(16)));
typedef union {
    f32x8 v;
    f32x4 h[2];
} f32x8_halves;
#define STORE8(NT, p, x)                                                                 \
    do {                                                                                 \
        if (NT) {                                                                        \
            const f32x8_halves u_ = {.v = (x)};                                          \
            _mm_stream_ps((p), (__m128)u_.h[0]);                                         \
            _mm_stream_ps((p) + 4, (__m128)u_.h[1]);                                     \
        } else {                                                                         \
            const f32x8 v_ = (x);                                                        \
            memcpy((p), &v_, sizeof v_);                                                 \
        }                                                                                \
    } while (0)
#else
#define STORE8(NT, p, x)                                                                 \
    do {                                                                                 \
        const f32x8 v_ = (x);                                                            \
        memcpy((p), &v_, sizeof v_);                                                     \
    } while (0)
#endif
#define BLOCK8(FLIP, MEAN_FILE, NT, J)                                                   \
    do {                                                                                 \
        const ptrdiff_t q = FLIP ? cw - 8 - (J) : (J);                                   \
        const f32x8 x = (PIXELS8(sy + q) - (MEAN_FILE ? FLOATS8(my + q) : mv8)) * sc;    \
        STORE8(NT, oy + (J), FLIP ? REVERSED8(x) : x);                                   \
    } while (0)
/* The contiguous case of lines_f32 (sstep and ostep 1), FLIP, MEAN_FILE and NT constant
 * in each expansion: 32 pixels a step, then 8, then one; the output written forward
 * (a mirrored NCHW row written backwards, its source read forward, took 1.3-1.4x the
 * time: W3's row, 3x256x256 cropped to 227 with a mean file). */
#define LINES8(FLIP, MEAN_FILE, NT)                                                      \
    for (ptrdiff_t y = 0; y < rows; y++) {                                               \
        float *const oy = o + y * orow;                                                  \
        const uint8_t *const sy = s + y * srow;                                          \
        const float *const my = MEAN_FILE ? m + y * mrow : NULL;                         \
        const float mv = MEAN_FILE || !has_mean ? 0.0f : m[y * mrow];                    \
        const f32x8 mv8 = (f32x8){mv, mv, mv, mv, mv, mv, mv, mv};                       \
        ptrdiff_t j = 0;                                                                 \
        for (; j + 32 <= cw; j += 32) {                                                  \
            BLOCK8(FLIP, MEAN_FILE, NT, j);                                              \
            BLOCK8(FLIP, MEAN_FILE, NT, j + 8);                                          \
            BLOCK8(FLIP, MEAN_FILE, NT, j + 16);                                         \
            BLOCK8(FLIP, MEAN_FILE, NT, j + 24);                                         \
        }                                                                                \
        for (; j + 8 <= cw; j += 8) BLOCK8(FLIP, MEAN_FILE, NT, j);                      \
        for (; j < cw; j++) {                                                            \
            const ptrdiff_t q = FLIP ? cw - 1 - j : j;                                   \
            oy[j] = ((float)sy[q] - (MEAN_FILE ? my[q] : mv)) * sc;                      \
        }                                                                                \
    }
#endif

/* lines_f32: `rows` contiguous output lines (line_f32 with sstep and ostep 1), line y
 * from the source line at s + y * srow and the mean at m + y * mrow (a mean file's
 * line, mstep 1; else one value), written at o + y * orow. One call makes a record's
 * channel plane, cropped (mrow: the mean file's W, or 0: one value), or an NHWC output
 * line's three channel lines (srow and mrow: a channel plane, or 1: the next value).
 * A call and line_f32's choice of loop a line cost a 1x28x28 record cropped to 24
 * and mirrored 4.7 times the instructions of its whole plane (2,432 against 520; 849
 * now), and the compiler's vector loop takes 32 pixels a step, so a 24- or 28-pixel
 * line went pixel by pixel. */
CLONES static void lines_f32(float *restrict o, ptrdiff_t orow, const uint8_t *restrict s,
                             ptrdiff_t srow, const float *restrict m, int mstep,
                             ptrdiff_t mrow, float scale, ptrdiff_t cw, ptrdiff_t rows,
                             int flip, int has_mean, int has_scale, int stream) {
#ifdef VEC8
    const int mean_file = has_mean && mstep;
    const float sc = has_scale ? scale : 1.0f;
    /* streamed only where every line is whole 64-byte cache lines, each written in
     * full by consecutive stores (a line written in part by movntps is written to
     * memory in part, at several times the cost) */
#define LINES8_OF(NT)                                                                    \
    if (flip && mean_file) {                                                             \
        LINES8(1, 1, NT)                                                                 \
    } else if (flip) {                                                                   \
        LINES8(1, 0, NT)                                                                 \
    } else if (mean_file) {                                                              \
        LINES8(0, 1, NT)                                                                 \
    } else {                                                                             \
        LINES8(0, 0, NT)                                                                 \
    }
    if (stream && (cw & 15) == 0 && ((uintptr_t)o & 63) == 0 && (rows == 1 || (orow & 15) == 0)) {
        LINES8_OF(1)
    } else {
        LINES8_OF(0)
    }
#undef LINES8_OF
#else
    (void)stream;
    for (ptrdiff_t y = 0; y < rows; y++)
        line_f32(o + y * orow, 1, s + y * srow, 1, has_mean ? m + y * mrow : NULL, mstep,
                 scale, cw, flip, has_mean, has_scale);
#endif
}

/* `rows` uint8 output lines (no mean, no scale; steps as line_f32's, strides as
 * lines_f32's), the loop inside the clone: a mirrored line's loop set up once for
 * them all (a call a line: 1.5x the instructions of a mirrored 227-pixel crop's uint8
 * row). */
CLONES static void lines_u8(uint8_t *restrict o, ptrdiff_t ostep, ptrdiff_t orow,
                            const uint8_t *restrict s, ptrdiff_t sstep, ptrdiff_t srow,
                            ptrdiff_t cw, ptrdiff_t rows, int flip) {
    if (!flip && ostep == 1 && sstep == 1) {
        for (ptrdiff_t y = 0; y < rows; y++) memcpy(o + y * orow, s + y * srow, (size_t)cw);
        return;
    }
    for (ptrdiff_t y = 0; y < rows; y++) {
        uint8_t *const oy = o + y * orow;
        const uint8_t *const sy = s + y * srow;
        for (ptrdiff_t j = 0; j < cw; j++) oy[j * ostep] = sy[(flip ? cw - 1 - j : j) * sstep];
    }
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

/* NAME(o, t0, t1, t2, n): o[3 * j + c] = t_c[AT]: three lines of T interleaved into one
 * (h, w, 3) line, forward (AT j) or reversed (AT n - 1 - j). */
#define INTERLEAVE3(NAME, T, AT)                                                         \
    CLONES static void NAME(T *restrict o, const T *restrict t0, const T *restrict t1,   \
                            const T *restrict t2, ptrdiff_t n) {                         \
        for (ptrdiff_t j = 0; j < n; j++) {                                              \
            o[3 * j] = t0[AT];                                                           \
            o[3 * j + 1] = t1[AT];                                                       \
            o[3 * j + 2] = t2[AT];                                                       \
        }                                                                                \
    }
INTERLEAVE3(interleave3, float, j)
INTERLEAVE3(interleave3_reversed, float, n - 1 - j)
INTERLEAVE3(interleave3_u8, uint8_t, j)
#undef INTERLEAVE3

/* An (h, w, 3) output line from three channel lines on the stack (t, FLIP_LINE
 * apart), reversed where mirrored. */
static inline void interleave3_line(float *line, float t[3][FLIP_LINE], ptrdiff_t cw,
                                    int flip) {
    if (flip)
        interleave3_reversed(line, t[0], t[1], t[2], cw);
    else
        interleave3(line, t[0], t[1], t[2], cw);
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
    Py_ssize_t size;            /* C*H*W: a record's pixels (C*H*W*4 fits a Py_ssize_t) */
    int hwc;                    /* source pixels (H, W, C) rather than (C, H, W) */
    int nhwc;                   /* output rows (h, w, C) rather than (C, h, w) */
    const float *mean;          /* NULL, C values, or C*H*W (a mean file) */
    int mstep;                  /* 1: a mean file */
    float scale;
    int itemsize; /* of the output: 4 float32, 1 uint8 */
    float *line;  /* NULL, or 3*cw floats of scratch for a mirrored (H, W, 3) line,
                     owned by the caller; one thread's at a time */
    int stream;   /* float32 lines of whole cache lines written around the caches
                     (lines_f32); the caller fences (STREAM_FENCE) before they are read */
} Spec;

/* The mean at a decoded colour image's source line (at: channel 0's position in
 * (C, H, W)) for its three channels: a mean file's lines, one value each, or NULL. */
static inline void mean_lines(const Spec *sp, Py_ssize_t at, const float **m0,
                              const float **m1, const float **m2) {
    const Py_ssize_t plane = sp->H * sp->W;
    if (sp->mean == NULL) {
        *m0 = *m1 = *m2 = NULL;
    } else if (sp->mstep) {
        *m0 = sp->mean + at, *m1 = sp->mean + plane + at, *m2 = sp->mean + 2 * plane + at;
    } else {
        *m0 = sp->mean, *m1 = sp->mean + 1, *m2 = sp->mean + 2;
    }
}

/* The widest crop line transform_image mirrors through a scratch line on its stack;
 * a wider one is mirrored in place. */
#define STACK_LINE 1024

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
                lines_f32((float *)o + o_at, 0, s0 + at, 0, m, sp->mstep, 0, sp->scale, ch * cw,
                          1, 0, sp->mean != NULL, sp->scale != 1.0f, sp->stream);
            }
        }
        return;
    }
    if (sp->hwc && C == 3 && sp->nhwc && sp->itemsize == 4 && cw <= FLIP_LINE) {
        /* a decoded colour image into (h, w, 3): each source line into three channel
         * lines on the stack (one pass, as into (3, h, w) below), then interleaved,
         * reversed where mirrored (each channel with a stride of 3, strided on both
         * sides, did not vectorise) */
        float t[3][FLIP_LINE];
        for (Py_ssize_t y = 0; y < ch; y++) {
            const uint8_t *s = s0 + ((h0 + y) * W + w0) * 3;
            const float *m0, *m1, *m2;
            mean_lines(sp, (h0 + y) * W + w0, &m0, &m1, &m2);
            line3_f32(t[0], t[1], t[2], s, m0, m1, m2, sp->mstep, sp->scale, cw,
                      sp->mean != NULL, sp->scale != 1.0f);
            interleave3_line((float *)o + y * cw * 3, t, cw, flip);
        }
        return;
    }
    if (sp->hwc && C == 3 && !sp->nhwc && sp->itemsize == 4) {
        /* a decoded colour image into (3, h, w): one pass over each source line */
        float *const out = (float *)o;
        /* a mirrored line goes through the caller's scratch line, then is copied
         * reversed (in place, scalar, where the caller has none) */
        float *scratch = flip ? sp->line : NULL;
        for (Py_ssize_t y = 0; y < ch; y++) {
            const uint8_t *s = s0 + ((h0 + y) * W + w0) * 3;
            float *o0 = out + y * cw, *o1 = out + (ch + y) * cw, *o2 = out + (2 * ch + y) * cw;
            const float *m0, *m1, *m2;
            mean_lines(sp, (h0 + y) * W + w0, &m0, &m1, &m2);
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
        return;
    }
    if (sp->nhwc && !sp->hwc && C == 3 && sp->itemsize == 1 && cw <= FLIP_LINE) {
        /* the same for uint8 rows (3.7-4x the time of NCHW, a channel at a time) */
        uint8_t t[3][FLIP_LINE];
        for (Py_ssize_t y = 0; y < ch; y++) {
            lines_u8((uint8_t *)t, 1, FLIP_LINE, s0 + (h0 + y) * W + w0, 1, H * W, cw, 3,
                     flip);
            interleave3_u8((uint8_t *)o + y * cw * 3, t[0], t[1], t[2], cw);
        }
        return;
    }
    if (sp->nhwc && !sp->hwc && C == 3 && sp->itemsize == 4 && cw <= FLIP_LINE) {
        /* (3, H, W) pixels into (h, w, 3) float32: each output line's three channels
         * computed forward into lines on the stack (one call), then interleaved,
         * reversed where mirrored (a channel at a time, with a stride of 3 and over the
         * whole row, did not vectorise and wrote every line three times: 2.5-3x the
         * time of NCHW) */
        float t[3][FLIP_LINE];
        for (Py_ssize_t y = 0; y < ch; y++) {
            const Py_ssize_t at = (h0 + y) * W + w0; /* channel 0's, uncropped, (C, H, W) */
            const float *m = sp->mean ? (sp->mstep ? sp->mean + at : sp->mean) : NULL;
            lines_f32((float *)t, FLIP_LINE, s0 + at, H * W, m, sp->mstep, sp->mstep ? H * W : 1,
                      sp->scale, cw, 3, 0, sp->mean != NULL, sp->scale != 1.0f, 0);
            interleave3_line((float *)o + y * cw * 3, t, cw, flip);
        }
        return;
    }
    /* a channel's ch lines in one call: output NCHW (c, y, 0), NHWC (y, 0, c); source
     * (C, H, W), or (H, W, C); a mean file (C, H, W) */
    const ptrdiff_t orow = sp->nhwc ? cw * C : cw, srow = sp->hwc ? W * C : W;
    for (Py_ssize_t c = 0; c < C; c++) {
        const Py_ssize_t at = (c * H + h0) * W + w0; /* uncropped, (C, H, W) */
        const uint8_t *s = s0 + (sp->hwc ? (h0 * W + w0) * C + c : at);
        const Py_ssize_t o_at = sp->nhwc ? c : c * ch * cw;
        if (sp->itemsize == 1) {
            lines_u8((uint8_t *)o + o_at, ostep, orow, s, sstep, srow, cw, ch, flip);
            continue;
        }
        const float *m = sp->mean ? (sp->mstep ? sp->mean + at : sp->mean + c) : NULL;
        const ptrdiff_t mrow = sp->mstep ? W : 0;
        if (ostep == 1 && sstep == 1) {
            lines_f32((float *)o + o_at, orow, s, srow, m, sp->mstep, mrow, sp->scale, cw, ch,
                      flip, sp->mean != NULL, sp->scale != 1.0f, sp->stream);
            continue;
        }
        for (Py_ssize_t y = 0; y < ch; y++)
            line_f32((float *)o + o_at + y * orow, ostep, s + y * srow, sstep,
                     m ? m + y * mrow : NULL, sp->mstep, sp->scale, cw, flip, sp->mean != NULL,
                     sp->scale != 1.0f);
    }
}

/* The spec from the arguments the entry points share, every size checked before it
 * is multiplied: a record of C*H*W pixels whose float32 bytes fit a Py_ssize_t, a crop
 * inside it, a float32 or uint8 output of exactly `rows` rows, a float32 mean of C or
 * C*H*W values; -1 with a ValueError set. sp->line is left NULL. */
static int make_spec(Spec *sp, Py_ssize_t C, Py_ssize_t H, Py_ssize_t W, Py_ssize_t crop,
                     int hwc, int nhwc, Buf *mb, double scale, Buf *ob, Py_ssize_t rows) {
    if (C <= 0 || H <= 0 || W <= 0 || crop < 0 || crop > H || crop > W) {
        PyErr_Format(PyExc_ValueError,
                     "bad shape (%zd, %zd, %zd) or crop %zd: the sizes must be positive and "
                     "the crop at most the height and the width",
                     C, H, W, crop);
        return -1;
    }
    Py_ssize_t hw, size, bytes;
    if (!mul_fits(H, W, &hw) || !mul_fits(hw, C, &size) || !mul_fits(size, 4, &bytes)) {
        PyErr_Format(PyExc_ValueError,
                     "the shape (%zd, %zd, %zd) is too large: its float32 bytes do not fit "
                     "a Py_ssize_t",
                     C, H, W);
        return -1;
    }
    sp->C = C, sp->H = H, sp->W = W, sp->size = size;
    sp->ch = crop ? crop : H, sp->cw = crop ? crop : W;
    sp->hwc = hwc, sp->nhwc = nhwc;
    sp->line = NULL;
    sp->stream = 0;
    const char kind = item_kind(&ob->view);
    if (!((kind == 'f' && ob->view.itemsize == 4) || (kind == 'u' && ob->view.itemsize == 1))) {
        PyErr_Format(PyExc_ValueError,
                     "out must be float32 or uint8, got items of format '%s' (%zd bytes)",
                     ob->view.format ? ob->view.format : "B", ob->view.itemsize);
        return -1;
    }
    sp->itemsize = (int)ob->view.itemsize;
    /* C*ch*cw*itemsize <= size*4: a row's bytes fit */
    const Py_ssize_t row = C * sp->ch * sp->cw * sp->itemsize;
    Py_ssize_t total;
    if (!mul_fits(rows, row, &total) || ob->view.len != total) {
        PyErr_Format(PyExc_ValueError,
                     "out must hold n rows of float32 or uint8: %zd rows of %zd bytes, got "
                     "%zd bytes",
                     rows, row, ob->view.len);
        return -1;
    }
    sp->mean = NULL;
    sp->mstep = 0;
    if (mb->held) {
        if (!items_are(mb, "f", 4, "mean", "float32")) return -1;
        if (mb->view.len != C * 4 && mb->view.len != bytes) {
            PyErr_Format(PyExc_ValueError,
                         "mean must be C or C*H*W float32 values (%zd or %zd), got %zd", C, size,
                         mb->view.len / 4);
            return -1;
        }
        sp->mean = (const float *)mb->view.buf;
        /* C values: one a channel, whatever the rows' sizes (also where H*W is 1, and a
         * mean file of C*1*1 values reads the same) */
        sp->mstep = mb->view.len != C * 4;
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

/* The outputs of a batch's rows: one writable buffer, or a tuple of them (of one
 * itemsize, each a whole number of rows) that take the rows in order. */
typedef struct {
    Py_ssize_t n; /* buffers */
    Buf *bufs;
    Buf all;             /* their lengths together, as one buffer (for make_spec) */
    Py_ssize_t k, first; /* out_row's place: buffer k holds rows from `first` on */
} Outs;

/* Acquire `out_o`'s buffers; -1 with an exception set. */
static int get_outs(PyObject *out_o, Outs *o) {
    o->n = PyTuple_Check(out_o) ? PyTuple_GET_SIZE(out_o) : 1;
    o->bufs = PyMem_Calloc(o->n > 0 ? (size_t)o->n : 1, sizeof(Buf));
    if (o->bufs == NULL) {
        o->n = 0;
        PyErr_NoMemory();
        return -1;
    }
    if (o->n < 1) {
        PyErr_SetString(PyExc_ValueError, "out must hold n rows of float32 or uint8");
        return -1;
    }
    for (Py_ssize_t k = 0; k < o->n; k++) {
        PyObject *item = PyTuple_Check(out_o) ? PyTuple_GET_ITEM(out_o, k) : out_o;
        if (get_buf(item, &o->bufs[k], PyBUF_WRITABLE, "out")) return -1;
    }
    o->all = o->bufs[0];
    o->all.view.len = 0;
    for (Py_ssize_t k = 0; k < o->n; k++) {
        const Py_buffer *v = &o->bufs[k].view;
        if (item_kind(v) != item_kind(&o->bufs[0].view) || v->itemsize != o->bufs[0].view.itemsize) {
            PyErr_SetString(PyExc_ValueError, "out must be arrays of one dtype, float32 or uint8");
            return -1;
        }
        if (v->len > PY_SSIZE_T_MAX - o->all.view.len) {
            PyErr_SetString(PyExc_ValueError, "out must hold n rows of float32 or uint8");
            return -1;
        }
        o->all.view.len += v->len;
    }
    o->k = o->first = 0;
    return 0;
}

/* Bytes of one output row. */
static Py_ssize_t row_bytes(const Spec *sp) { return sp->C * sp->ch * sp->cw * sp->itemsize; }

/* Each buffer a whole number of rows (after make_spec checked their total); -1 with
 * an exception set. */
static int outs_in_rows(const Outs *o, const Spec *sp) {
    for (Py_ssize_t k = 0; k < o->n; k++) {
        if (o->bufs[k].view.len % row_bytes(sp) != 0) {
            PyErr_SetString(PyExc_ValueError, "each out must hold a whole number of rows");
            return -1;
        }
    }
    return 0;
}

/* Row i's place in the outputs; rows are asked for in increasing order. No GIL needed. */
static void *out_row(Outs *o, const Spec *sp, Py_ssize_t i) {
    const Py_ssize_t rb = row_bytes(sp);
    while ((i - o->first) * rb >= o->bufs[o->k].view.len) {
        o->first += o->bufs[o->k].view.len / rb;
        o->k++;
    }
    return (uint8_t *)o->bufs[o->k].view.buf + (i - o->first) * rb;
}

static void release_outs(Outs *o) {
    for (Py_ssize_t k = 0; k < o->n; k++) release(&o->bufs[k]);
    PyMem_Free(o->bufs);
    o->bufs = NULL;
    o->n = 0;
}


/* A batch's images: row i's bytes at p[i] (len[i] of them), p[i] NULL where the row
 * is left alone. Given as a sequence of buffers (None: left), each acquired; or as one
 * buffer and an (n, 2) int64 array of extents (offset, length) in it (offset -1:
 * left), every extent checked inside the buffer. */
typedef struct {
    Py_ssize_t n;
    PyObject *seq; /* the sequence form: the images, as a fast sequence */
    Buf *bufs;     /* the sequence form: row i's buffer; not held where it is None */
    Buf data, eb;  /* the extents form: the buffer and the extents */
    const unsigned char **p;
    Py_ssize_t *len;
} Images;

static inline void release_images(Images *im) {
    if (im->bufs != NULL)
        for (Py_ssize_t i = 0; i < im->n; i++) release(&im->bufs[i]);
    PyMem_Free(im->bufs);
    im->bufs = NULL;
    PyMem_Free((void *)im->p);
    im->p = NULL;
    PyMem_Free(im->len);
    im->len = NULL;
    release(&im->data);
    release(&im->eb);
    Py_CLEAR(im->seq);
}

/* Acquire `images_o` (with `extents_o`, or Py_None for the sequence form); -1 with an
 * exception set (release_images then releases what was acquired). */
static inline int get_images(Images *im, PyObject *images_o, PyObject *extents_o) {
    memset(im, 0, sizeof(*im));
    if (extents_o == Py_None) {
        im->seq = PySequence_Fast(images_o, "images must be a sequence");
        if (im->seq == NULL) return -1;
        im->n = PySequence_Fast_GET_SIZE(im->seq);
    } else {
        if (get_buf(images_o, &im->data, 0, "images") || get_buf(extents_o, &im->eb, 0, "extents"))
            return -1;
        if (!items_are(&im->eb, "i", 8, "extents", "int64")) return -1;
        if (im->eb.view.len % 16 != 0) {
            PyErr_SetString(PyExc_ValueError, "extents must be (offset, length) per image");
            return -1;
        }
        im->n = im->eb.view.len / 16;
    }
    const size_t n = im->n > 0 ? (size_t)im->n : 1;
    im->p = PyMem_Calloc(n, sizeof(*im->p));
    im->len = PyMem_Calloc(n, sizeof(*im->len));
    if (im->seq != NULL) im->bufs = PyMem_Calloc(n, sizeof(Buf));
    if (im->p == NULL || im->len == NULL || (im->seq != NULL && im->bufs == NULL)) {
        PyErr_NoMemory();
        return -1;
    }
    if (im->seq != NULL) {
        for (Py_ssize_t i = 0; i < im->n; i++) {
            PyObject *item = PySequence_Fast_GET_ITEM(im->seq, i);
            if (item == Py_None) continue;
            if (get_buf(item, &im->bufs[i], 0, "images")) return -1;
            im->p[i] = (const unsigned char *)im->bufs[i].view.buf;
            im->len[i] = im->bufs[i].view.len;
        }
        return 0;
    }
    const int64_t *e = (const int64_t *)im->eb.view.buf;
    const Py_ssize_t size = im->data.view.len;
    for (Py_ssize_t i = 0; i < im->n; i++) {
        const int64_t at = e[2 * i], len = e[2 * i + 1];
        if (at == -1) continue;
        /* compared without a sum that could overflow */
        if (at < 0 || len < 0 || at > (int64_t)size || len > (int64_t)size - at) {
            PyErr_Format(PyExc_ValueError, "image %zd's extent (%lld, %lld) is outside the %zd "
                         "bytes of images", i, (long long)at, (long long)len, size);
            return -1;
        }
        im->p[i] = (const unsigned char *)im->data.view.buf + at;
        im->len[i] = (Py_ssize_t)len;
    }
    return 0;
}

/* A batch of encoded images going into their output rows: the arguments and state of
 * the decoders' decode_rows (_jpegwindow.c, _pngrows.c), which decode row i's image
 * (im.p[i], im.len[i]) into `scratch` as (H_i, W_i, 3) BGR rows (row_size: the batch's
 * shape (3, H, W), or row i's own size where the call has `sizes`) and then call
 * row_done. */
typedef struct {
    Images im;
    Py_ssize_t n;
    Buf hb, wb, fb, mb, sb;
    Outs outs;
    Spec sp;
    const Py_ssize_t *hs, *ws;
    const uint8_t *flips;
    const Py_ssize_t *sizes; /* NULL, or (H_i, W_i) per row: 2*n values */
    Py_ssize_t max_h;        /* the tallest row's height */
    PyObject *status;        /* bytes, one per row: 1 written */
    char *st;
    unsigned char *scratch; /* the largest row's H_i*W_i*3 bytes */
    float *line;            /* sp.line: a mirrored line's scratch, one for the call */
} Rows;

static inline void release_rows(Rows *r) {
    PyMem_RawFree(r->scratch);
    r->scratch = NULL;
    PyMem_RawFree(r->line);
    r->line = NULL;
    Py_CLEAR(r->status);
    release_images(&r->im);
    release(&r->hb);
    release(&r->wb);
    release(&r->fb);
    release(&r->mb);
    release(&r->sb);
    release_outs(&r->outs);
}

/* Row i's image size: its own where the call has sizes, else the batch's. No GIL needed. */
static inline void row_size(const Rows *r, Py_ssize_t i, Py_ssize_t *H, Py_ssize_t *W) {
    if (r->sizes != NULL) {
        *H = r->sizes[2 * i];
        *W = r->sizes[2 * i + 1];
    } else {
        *H = r->sp.H;
        *W = r->sp.W;
    }
}

/* Every row's size checked against the spec (made for the batch's shape): positive,
 * its H*W*C float32 bytes fit a Py_ssize_t, the crop inside it, and the batch's own
 * size wherever a row's output or mean depends on it (no crop: the output row is the
 * image; a mean file: it is the batch's H*W); *largest: the largest row's H*W*3.
 * -1 with a ValueError set. */
static inline int check_sizes(Rows *r, Py_ssize_t crop, Py_ssize_t *largest) {
    const Spec *sp = &r->sp;
    *largest = sp->size;
    r->max_h = sp->H;
    if (r->sizes == NULL) return 0;
    *largest = 0;
    r->max_h = 0;
    for (Py_ssize_t i = 0; i < r->n; i++) {
        Py_ssize_t H, W, hw, size, bytes;
        row_size(r, i, &H, &W);
        if (H <= 0 || W <= 0 || !mul_fits(H, W, &hw) || !mul_fits(hw, sp->C, &size) ||
            !mul_fits(size, 4, &bytes)) {
            PyErr_Format(PyExc_ValueError,
                         "row %zd's size %zdx%zd must be positive and its float32 bytes fit "
                         "a Py_ssize_t", i, H, W);
            return -1;
        }
        if (H < sp->ch || W < sp->cw ||
            ((!crop || (sp->mean != NULL && sp->mstep)) && (H != sp->H || W != sp->W))) {
            PyErr_Format(PyExc_ValueError,
                         "row %zd's size %zdx%zd does not make a row of the batch (crop %zdx%zd"
                         "; without a crop, or with a mean file, each row must be %zdx%zd)",
                         i, H, W, sp->ch, sp->cw, sp->H, sp->W);
            return -1;
        }
        if (r->hs[i] < 0 || r->ws[i] < 0 || r->hs[i] > H - sp->ch || r->ws[i] > W - sp->cw) {
            PyErr_Format(PyExc_ValueError, "row %zd's crop does not fit", i);
            return -1;
        }
        if (r->im.p[i] != NULL && size > *largest) *largest = size;
        if (r->im.p[i] != NULL && H > r->max_h) r->max_h = H;
    }
    return 0;
}

/* Acquire and check the arguments (every crop inside its image, the outputs n rows);
 * -1 with an exception set and nothing held. */
static inline int open_rows(Rows *r, PyObject *images_o, Py_ssize_t C, Py_ssize_t H, Py_ssize_t W,
                            PyObject *h_o, PyObject *w_o, PyObject *flip_o, PyObject *mean_o,
                            double scale, PyObject *out_o, Py_ssize_t crop, int nhwc,
                            PyObject *sizes_o, PyObject *extents_o) {
    memset(r, 0, sizeof(*r));
    if (get_images(&r->im, images_o, extents_o)) goto fail;
    r->n = r->im.n;
    if (get_buf(h_o, &r->hb, 0, "h_off") || get_buf(w_o, &r->wb, 0, "w_off") ||
        get_buf(flip_o, &r->fb, 0, "mirror") ||
        (mean_o != Py_None && get_buf(mean_o, &r->mb, 0, "mean")) ||
        (sizes_o != Py_None && get_buf(sizes_o, &r->sb, 0, "sizes")) || get_outs(out_o, &r->outs))
        goto fail;
    const Py_ssize_t n = r->n;
    if (!items_are(&r->hb, "i", (Py_ssize_t)sizeof(Py_ssize_t), "h_off", "intp") ||
        !items_are(&r->wb, "i", (Py_ssize_t)sizeof(Py_ssize_t), "w_off", "intp") ||
        !items_are(&r->fb, "?u", 1, "mirror", "bool or uint8") ||
        (r->sb.held && !items_are(&r->sb, "i", (Py_ssize_t)sizeof(Py_ssize_t), "sizes", "intp")))
        goto fail;
    if (r->hb.view.len / r->hb.view.itemsize != n || r->wb.view.len / r->wb.view.itemsize != n ||
        r->fb.view.len != n) {
        PyErr_SetString(PyExc_ValueError, "h_off, w_off and mirror must be one per image");
        goto fail;
    }
    /* n <= PY_SSIZE_T_MAX / sizeof(Py_ssize_t): h_off holds n of them */
    if (r->sb.held && r->sb.view.len / r->sb.view.itemsize != 2 * n) {
        PyErr_SetString(PyExc_ValueError, "sizes must be (height, width) per image");
        goto fail;
    }
    if (C != 3) {
        PyErr_SetString(PyExc_ValueError, "the images' shape must be (3, H, W)");
        goto fail;
    }
    /* H*W*3 fits once make_spec has checked the shape */
    if (make_spec(&r->sp, C, H, W, crop, 1, nhwc, &r->mb, scale, &r->outs.all, n) < 0) goto fail;
    if (outs_in_rows(&r->outs, &r->sp) < 0) goto fail;
    r->hs = (const Py_ssize_t *)r->hb.view.buf;
    r->ws = (const Py_ssize_t *)r->wb.view.buf;
    r->flips = (const uint8_t *)r->fb.view.buf;
    r->sizes = r->sb.held ? (const Py_ssize_t *)r->sb.view.buf : NULL;
    if (r->sizes == NULL) {
        for (Py_ssize_t i = 0; i < n; i++)
            if (!crop_fits(&r->sp, r->hs[i], r->ws[i], i)) goto fail;
    }
    Py_ssize_t largest;
    if (check_sizes(r, crop, &largest) < 0) goto fail;
    r->status = PyBytes_FromStringAndSize(NULL, n);
    if (r->status == NULL) goto fail;
    r->st = PyBytes_AS_STRING(r->status);
    memset(r->st, 0, (size_t)n);
    r->scratch = PyMem_RawMalloc(largest > 0 ? (size_t)largest : 1);
    r->line = PyMem_RawMalloc((size_t)r->sp.cw * 3 * sizeof(float));
    if (r->scratch == NULL || r->line == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    r->sp.line = r->line;
    return 0;
fail:
    release_rows(r);
    return -1;
}

/* open_rows from decode_rows's arguments: (images, (C, H, W), h_off, w_off, mirror,
 * mean, scale, out, crop, nhwc[, sizes[, extents]]); -1 with an exception set and
 * nothing held. */
static inline int rows_from_args(Rows *r, PyObject *args) {
    PyObject *images_o, *h_o, *w_o, *flip_o, *mean_o, *out_o, *sizes_o = Py_None,
                                                               *extents_o = Py_None;
    Py_ssize_t C, H, W, crop;
    double scale;
    int nhwc;
    if (!PyArg_ParseTuple(args, "O(nnn)OOOOdOni|OO", &images_o, &C, &H, &W, &h_o, &w_o, &flip_o,
                          &mean_o, &scale, &out_o, &crop, &nhwc, &sizes_o, &extents_o))
        return -1;
    return open_rows(r, images_o, C, H, W, h_o, w_o, flip_o, mean_o, scale, out_o, crop, nhwc,
                     sizes_o, extents_o);
}

/* Row i's image is in scratch: transform it into its output row. No GIL needed. */
static inline void row_done(Rows *r, Py_ssize_t i) {
    Spec sp = r->sp; /* the batch's; a row of its own size reads its own lines */
    row_size(r, i, &sp.H, &sp.W);
    sp.size = sp.C * sp.H * sp.W;
    transform_one(&sp, r->scratch, r->hs[i], r->ws[i], r->flips[i] != 0,
                  out_row(&r->outs, &r->sp, i));
    r->st[i] = 1;
}

/* The scratch let go of, at the end of the GIL-free section (a large one is unmapped:
 * a system call the other threads need not wait for). No GIL needed. */
static inline void free_scratch(Rows *r) {
    PyMem_RawFree(r->scratch);
    r->scratch = NULL;
    PyMem_RawFree(r->line);
    r->line = NULL;
    r->sp.line = NULL;
}

/* The status bytes (a new reference); everything else released. */
static inline PyObject *close_rows(Rows *r) {
    PyObject *status = r->status;
    r->status = NULL;
    release_rows(r);
    return status;
}

/* The CPU time this module's calls spend without the GIL (this thread's CPU clock
 * around each GIL-free section, summed over threads), counted only while counting
 * is on: how a benchmark splits a batch's CPU time into GIL-free work and the rest
 * (free_cpu). Off, a section costs one load and one branch.
 *
 * A section that runs while counting is on is noted (its thread's clock and where
 * it was last counted from, FREE_SLOTS at once, under free_mu), so that a read
 * (free_cpu) counts each one's time so far: a measurement that ends while a worker
 * is inside a section has that section's CPU time in the process's clock, and
 * counting it only at its end would count it as holding the GIL (on W4, a batch's
 * decode of ~25 ms a filler, up to a third of what a two-epoch measurement counted
 * as held). Turning counting off counts the sections running then up to that
 * point, and no further. A section that began before counting was turned on is
 * not counted: measure from an idle process. Elsewhere than Linux (no clock of
 * another thread), and beyond FREE_SLOTS sections at once, a section is counted
 * when it ends, as before. */
#include <time.h>

static int free_counting;
static long long free_ns;

static long long thread_cpu_ns(void) {
    struct timespec t;
    if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t) != 0) return 0;
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

#if defined(__linux__)
#include <pthread.h>
#include <sys/types.h>
#include <unistd.h>
#define FREE_SLOTS 1024
typedef struct {
    clockid_t clock; /* the section's thread's CPU clock */
    long long from;  /* counted up to this reading of it */
    int used;        /* a section runs */
    int counting;    /* and its time still counts (counting was not turned off since) */
} FreeSlot;
static FreeSlot free_slots[FREE_SLOTS];
static pthread_mutex_t free_mu = PTHREAD_MUTEX_INITIALIZER;
/* the process the slots are of: a forked child (whose copy of free_mu may be held by a
 * thread it does not have) notes nothing until free_cpu starts its own */
static pid_t free_pid;

static long long clock_ns(clockid_t clock) {
    struct timespec t;
    if (clock_gettime(clock, &t) != 0) return -1;
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* A section begins: its slot (-1: none, *t0 its start where counting, else -1). */
static int free_begin(long long *t0) {
    *t0 = -1;
    if (!free_counting) return -1;
    clockid_t clock;
    if (getpid() == free_pid && pthread_getcpuclockid(pthread_self(), &clock) == 0) {
        pthread_mutex_lock(&free_mu);
        for (int k = 0; k < FREE_SLOTS; k++) {
            if (!free_slots[k].used) {
                const long long now = clock_ns(clock);
                if (now < 0) break;
                free_slots[k] = (FreeSlot){clock, now, 1, 1};
                pthread_mutex_unlock(&free_mu);
                return k;
            }
        }
        pthread_mutex_unlock(&free_mu);
    }
    *t0 = thread_cpu_ns();
    return -1;
}

/* The section of slot k (or started at t0) ends: its time since it was last counted. */
static void free_end(int k, long long t0) {
    if (k >= 0) {
        pthread_mutex_lock(&free_mu);
        FreeSlot *f = &free_slots[k];
        const long long now = clock_ns(f->clock);
        if (f->counting && now > f->from)
            __atomic_fetch_add(&free_ns, now - f->from, __ATOMIC_RELAXED);
        f->used = 0;
        pthread_mutex_unlock(&free_mu);
    } else if (t0 >= 0) {
        __atomic_fetch_add(&free_ns, thread_cpu_ns() - t0, __ATOMIC_RELAXED);
    }
}

/* Count the running sections' time so far; `stop`: and none of it after now. */
static void free_so_far(int stop) {
    if (getpid() != free_pid) { /* (a forked child: the parent's sections are not its own) */
        pthread_mutex_init(&free_mu, NULL);
        memset(free_slots, 0, sizeof(free_slots));
        free_pid = getpid();
        return;
    }
    pthread_mutex_lock(&free_mu);
    for (int k = 0; k < FREE_SLOTS; k++) {
        FreeSlot *f = &free_slots[k];
        if (!f->used || !f->counting) continue;
        const long long now = clock_ns(f->clock);
        if (now > f->from) {
            __atomic_fetch_add(&free_ns, now - f->from, __ATOMIC_RELAXED);
            f->from = now;
        }
        if (stop) f->counting = 0;
    }
    pthread_mutex_unlock(&free_mu);
}

/* Inside Py_BEGIN_ALLOW_THREADS ... Py_END_ALLOW_THREADS, around the work. */
#define FREE_BEGIN                                                                   \
    long long free_t0_;                                                              \
    const int free_k_ = free_begin(&free_t0_);
#define FREE_END free_end(free_k_, free_t0_);
#else
static void free_so_far(int stop) { (void)stop; }
#define FREE_BEGIN const long long free_t0_ = free_counting ? thread_cpu_ns() : -1;
#define FREE_END                                                                     \
    if (free_t0_ >= 0) __atomic_fetch_add(&free_ns, thread_cpu_ns() - free_t0_, __ATOMIC_RELAXED);
#endif

static PyObject *free_cpu(PyObject *self, PyObject *on) {
    (void)self;
    const int counting = PyObject_IsTrue(on);
    if (counting < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS;
    free_so_far(!counting);
    Py_END_ALLOW_THREADS;
    free_counting = counting;
    return PyLong_FromLongLong(__atomic_load_n(&free_ns, __ATOMIC_RELAXED));
}

#define FREE_CPU_METHOD                                                                   \
    {"free_cpu", free_cpu, METH_O,                                                        \
     "free_cpu(counting) -> int: nanoseconds of CPU time this module's calls spent "      \
     "without the GIL while counting was on (all threads), the calls still running "     \
     "counted up to now; turns counting on or off."}

/* What an image's header announces, for drawing each row's crop before its decode:
 * IMAGE_JPEG (the SOI marker) with the first frame header's height and width, markers
 * read as libjpeg reads them (_imagehead.py's jpeg_frame: bytes other than 0xFF skipped,
 * fill bytes swallowed, 0xFF 0x00, TEM and RSTn without a segment, every other segment
 * skipped by its length; none before SOS, EOI, another SOI or the end: 0 × 0);
 * IMAGE_PNG (the PNG signature) with the IHDR chunk's (0 × 0 where there is none, or a
 * side above 2^31 - 1); else IMAGE_OTHER, 0 × 0. Only a hint: a decoder still checks
 * that the image it decodes has the size it was given, and leaves it otherwise. */
enum { IMAGE_OTHER = 0, IMAGE_JPEG = 1, IMAGE_PNG = 2 };

static inline int header_size(const unsigned char *b, Py_ssize_t n, Py_ssize_t *h,
                              Py_ssize_t *w) {
    *h = *w = 0;
    if (n >= 8 && memcmp(b, "\x89PNG\r\n\x1a\n", 8) == 0) {
        if (n >= 24 && memcmp(b + 12, "IHDR", 4) == 0) {
            const uint32_t pw = ((uint32_t)b[16] << 24) | ((uint32_t)b[17] << 16) |
                                ((uint32_t)b[18] << 8) | b[19];
            const uint32_t ph = ((uint32_t)b[20] << 24) | ((uint32_t)b[21] << 16) |
                                ((uint32_t)b[22] << 8) | b[23];
            if (pw <= 0x7FFFFFFFu && ph <= 0x7FFFFFFFu) *h = (Py_ssize_t)ph, *w = (Py_ssize_t)pw;
        }
        return IMAGE_PNG;
    }
    if (n < 2 || b[0] != 0xFF || b[1] != 0xD8) return IMAGE_OTHER;
    Py_ssize_t i = 2;
    while (i < n) {
        if (b[i] != 0xFF) {
            i++;
            continue;
        }
        while (i + 1 < n && b[i + 1] == 0xFF) i++; /* fill bytes */
        if (i + 1 >= n) break;
        const unsigned m = b[i + 1];
        if (m == 0x00 || m == 0x01 || (m >= 0xD0 && m <= 0xD7)) { /* no segment */
            i += 2;
            continue;
        }
        if (m == 0xD8 || m == 0xD9 || m == 0xDA || n - i < 4) break;
        const Py_ssize_t len = ((Py_ssize_t)b[i + 2] << 8) | b[i + 3];
        if (len < 2) break;
        if (m >= 0xC0 && m <= 0xCF && m != 0xC4 && m != 0xC8 && m != 0xCC) { /* SOFn */
            if (n - i >= 10) {
                *h = ((Py_ssize_t)b[i + 5] << 8) | b[i + 6];
                *w = ((Py_ssize_t)b[i + 7] << 8) | b[i + 8];
            }
            break;
        }
        i += 2 + len;
    }
    return IMAGE_JPEG;
}

/* image_sizes(images[, extents]) -> bytes: per image (as decode_rows takes them; a row
 * left alone: IMAGE_OTHER, 0 × 0) three Py_ssize_t, (format, height, width) as
 * header_size reads them. The headers are read without the GIL: a few bytes of each,
 * but each read waits on memory (a batch's images lie apart in a large file), and the
 * decode that follows finds them in cache. */
static inline PyObject *image_sizes(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *images_o, *extents_o = Py_None, *out = NULL;
    if (!PyArg_ParseTuple(args, "O|O", &images_o, &extents_o)) return NULL;
    Images im;
    if (get_images(&im, images_o, extents_o)) goto done;
    const Py_ssize_t n = im.n;
    out = n <= PY_SSIZE_T_MAX / (3 * (Py_ssize_t)sizeof(Py_ssize_t))
              ? PyBytes_FromStringAndSize(NULL, 3 * n * (Py_ssize_t)sizeof(Py_ssize_t))
              : PyErr_NoMemory();
    if (out == NULL) goto done;
    Py_ssize_t *at = (Py_ssize_t *)PyBytes_AS_STRING(out);
    Py_BEGIN_ALLOW_THREADS;
    FREE_BEGIN
    for (Py_ssize_t i = 0; i < n; i++, at += 3) {
        at[0] = IMAGE_OTHER, at[1] = at[2] = 0;
        if (im.p[i] != NULL) at[0] = header_size(im.p[i], im.len[i], &at[1], &at[2]);
    }
    FREE_END
    Py_END_ALLOW_THREADS;
done:
    release_images(&im);
    return out;
}

#define IMAGE_SIZES_METHOD                                                                \
    {"image_sizes", image_sizes, METH_VARARGS,                                            \
     "image_sizes(images[, extents]) -> bytes: per image (as decode_rows takes them) "     \
     "three native Py_ssize_t, (format, height, width) from its header: format 1 a JPEG " \
     "(its first frame header's size), 2 a PNG (its IHDR's), 0 neither or none; 0 x 0 "   \
     "where the size cannot be read."}

#endif
