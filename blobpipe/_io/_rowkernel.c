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
 * file_size(fd) -> int: the length of the open file fd (fstat), the GIL held: the
 * per-read check that an LMDB data file did not shrink under its map runs once a
 * batch, and a GIL released around the call (as os.fstat and mmap.size do) hands
 * the GIL to a waiting thread and waits to get it back, twice a batch.
 *
 * resident(buffer, first, last) -> bytes: per span of pages [first[i], last[i]] (intp
 * page numbers) of `buffer` (a file's map: it must start at a page boundary), 1 where
 * the span lies inside the buffer and its pages are in the page cache (a span of more
 * than 32 pages: its first and last), else 0 (mincore: it looks pages up, faults
 * nothing in and never waits, so the GIL is kept). The read-ahead's check of what a
 * request would read (_readahead.missing): one call for all its ranges, one mincore
 * a range, where a call a page through ctypes cost 2-10 us (Linux only).
 *
 * take(src, rows, out): out[k] = src[rows[k]] for items of 4 or 8 bytes (src and out
 * of one item size, rows intp, each checked against src), the GIL held: NumPy
 * releases it to gather more than 500 items (an index's offsets and labels for a
 * chunk of rows: a hand-off to a waiting thread, twice a chunk).
 *
 * match_raw(buffer, offsets, lengths, header, size, good, labels) -> int: which of
 * the records buffer[offsets[i]:offsets[i] + lengths[i]] are in convert_imageset's raw
 * layout: `header` (the Datum's channels, height, width, the data field's tag and
 * length: _encode.raw_header), `size` pixels, then 0x28 varint(label) and optionally
 * 0x38 0x00 (encoded: false), nothing else. good[i] (uint8) is 1 for such a record, and
 * labels[i] (int32) its label, the varint's low 32 bits as protobuf reads an int32; 0
 * and 0 for any other. Returns how many are good. The rule is _records._match_layout's
 * (NumPy's path where this module is not built). Only each record's header and the
 * bytes after its pixels are read; the GIL is released for the pass (each pass reads a
 * page or two of every record: first reads of the map fault them in), which runs once
 * a batch at most and a few times an epoch.
 *
 * The arithmetic is Caffe's, in float32, each step rounded:
 * (float)x - mean at the pixel's uncropped position, then * scale; without a
 * mean (float)x * scale; with scale 1 the product is skipped (x * 1 == x).
 * Mirroring reverses each output row: out column j takes the crop's column
 * (w - 1 - j), pixel and mean alike.
 *
 * Before the GIL is released, every buffer's format (not only its item size), its
 * layout (C-contiguous) and its count are checked, every size is checked for overflow
 * before it is multiplied, and every offset and crop corner against the buffers
 * (ValueError naming the argument or the row): no read or write outside them, no item
 * of one type read as another.
 * Built with -ffp-contract=off: no fused multiply-add changes a rounding.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_kernel.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <time.h>
#include <sys/stat.h>
#include <unistd.h>

/* The first PREFETCH_BYTES of the row PREFETCH_ROWS on asked for while this row is
 * transformed: a batch's records lie apart in the file map (a page or more each), and
 * the hardware prefetcher does not cross a page, so each record's first lines waited
 * on memory (a 1x28x28 row transforms in ~65 ns from cache, ~340 ns from the map;
 * ~215 ns with its first 4 KB asked for four rows ahead: 16 KB in flight, within L1). */
#define PREFETCH_BYTES 4096
#define PREFETCH_ROWS 4
static inline void prefetch_row(const Spec *sp, const uint8_t *s) {
    const Py_ssize_t n = sp->size < PREFETCH_BYTES ? sp->size : PREFETCH_BYTES;
    for (Py_ssize_t k = 0; k < n; k += 64) __builtin_prefetch(s + k, 0, 3);
}

/* A transform_rows call: its buffers held (released with the GIL, release_call),
 * everything checked (parse_call), ready to run without the GIL (run_call). */
typedef struct {
    Buf src, off, hb, wb, fb, mb;
    Outs outs;
    Spec sp;
    Py_ssize_t n;
} RowsCall;

static void release_call(RowsCall *c) {
    release(&c->src);
    release(&c->off);
    release(&c->hb);
    release(&c->wb);
    release(&c->fb);
    release(&c->mb);
    release_outs(&c->outs);
}

/* Acquire and check transform_rows' arguments into *c (zeroed by the caller); -1 with
 * an exception set (the caller releases what was acquired). */
static int parse_call(PyObject *args, RowsCall *c) {
    PyObject *src_o, *off_o, *h_o, *w_o, *flip_o, *mean_o, *out_o;
    Py_ssize_t C, H, W, crop;
    double scale;
    int nhwc;
    if (!PyArg_ParseTuple(args, "OO(nnn)OOOOdOni", &src_o, &off_o, &C, &H, &W, &h_o, &w_o,
                          &flip_o, &mean_o, &scale, &out_o, &crop, &nhwc))
        return -1;
    if (get_buf(src_o, &c->src, 0, "src") || get_buf(off_o, &c->off, 0, "offsets") ||
        get_buf(h_o, &c->hb, 0, "h_off") || get_buf(w_o, &c->wb, 0, "w_off") ||
        get_buf(flip_o, &c->fb, 0, "mirror") ||
        (mean_o != Py_None && get_buf(mean_o, &c->mb, 0, "mean")))
        return -1;
    if (get_outs(out_o, &c->outs)) return -1;
    if (!items_are(&c->src, "uc", 1, "src", "uint8 (bytes)") ||
        !items_are(&c->off, "i", 8, "offsets", "int64") ||
        !items_are(&c->hb, "i", (Py_ssize_t)sizeof(Py_ssize_t), "h_off", "intp") ||
        !items_are(&c->wb, "i", (Py_ssize_t)sizeof(Py_ssize_t), "w_off", "intp") ||
        !items_are(&c->fb, "?u", 1, "mirror", "bool or uint8"))
        return -1;
    const Py_ssize_t n = c->n = c->off.view.len / 8;
    if (c->hb.view.len / c->hb.view.itemsize != n || c->wb.view.len / c->wb.view.itemsize != n ||
        c->fb.view.len != n) {
        PyErr_SetString(PyExc_ValueError, "offsets, h_off, w_off and mirror must be one per row");
        return -1;
    }
    Spec *sp = &c->sp;
    if (make_spec(sp, C, H, W, crop, 0, nhwc, &c->mb, scale, &c->outs.all, n) < 0) return -1;
    if (outs_in_rows(&c->outs, sp) < 0) return -1;
    const int64_t *offsets = (const int64_t *)c->off.view.buf;
    const Py_ssize_t *hs = (const Py_ssize_t *)c->hb.view.buf, *ws = (const Py_ssize_t *)c->wb.view.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (offsets[i] < 0 || offsets[i] > c->src.view.len - sp->size) {
            PyErr_Format(PyExc_ValueError, "row %zd lies outside the buffer", i);
            return -1;
        }
        if (!crop_fits(sp, hs[i], ws[i], i)) return -1;
    }
    return 0;
}

/* The checked call's rows lo to hi, without the GIL (any thread; several threads may
 * run disjoint ranges of one call at once: each finds its rows' outputs from a cursor
 * of its own). The caller counts the GIL-free time (FREE_BEGIN): per call, or per job a
 * pool thread or a waiter works on (a count per block read two thread clocks, and took
 * a lock, a block while a benchmark counts). */
static void run_rows(const RowsCall *c, Py_ssize_t lo, Py_ssize_t hi) {
    const Spec *sp = &c->sp;
    const int64_t *offsets = (const int64_t *)c->off.view.buf;
    const Py_ssize_t *hs = (const Py_ssize_t *)c->hb.view.buf, *ws = (const Py_ssize_t *)c->wb.view.buf;
    const uint8_t *flips = (const uint8_t *)c->fb.view.buf;
    const uint8_t *base = (const uint8_t *)c->src.view.buf;
    Outs outs = c->outs; /* the buffers shared; out_row's place this range's own */
    outs.k = outs.first = 0;
    for (Py_ssize_t i = lo + 1; i < lo + PREFETCH_ROWS && i < hi; i++)
        prefetch_row(sp, base + offsets[i]);
    for (Py_ssize_t i = lo; i < hi; i++) {
        if (i + PREFETCH_ROWS < hi) prefetch_row(sp, base + offsets[i + PREFETCH_ROWS]);
        transform_one(sp, base + offsets[i], hs[i], ws[i], flips[i] != 0, out_row(&outs, sp, i));
    }
}

static void run_call(RowsCall *c) {
    FREE_BEGIN
    run_rows(c, 0, c->n);
    FREE_END
}

static PyObject *transform_rows(PyObject *self, PyObject *args) {
    RowsCall c;
    memset(&c, 0, sizeof c);
    PyObject *result = NULL;
    if (parse_call(args, &c) == 0) {
        Py_BEGIN_ALLOW_THREADS;
        run_call(&c);
        Py_END_ALLOW_THREADS;
        Py_INCREF(Py_None);
        result = Py_None;
    }
    release_call(&c);
    return result;
}

/* ---- Pool: transform_rows calls run by threads that never take the GIL ----------
 *
 * Pool(threads) -> a pool of `threads` POSIX threads (started with the first call);
 * pool.start(*transform_rows arguments) -> Job: the call checked at once (the same
 * errors as transform_rows, raised here), queued, and run by a pool thread, which
 * claims its rows a block at a time (POOL_BLOCK_ROWS, POOL_BLOCK_BYTES).
 * job.query() -> bool: whether it ran; job.synchronize(): wait until it ran, the GIL
 * released, writing the blocks no thread claimed yet itself (a waiting consumer writes
 * rows rather than leave its core idle); job.wait(seconds) -> bool: wait at most that
 * long (the GIL released; for seconds > 0 writing unclaimed blocks the same way, the
 * time looked at after each), whether it ran (timed on CLOCK_MONOTONIC where the
 * condition variable can take it: a change of the wall clock neither cuts nor stretches
 * it); job.rows() -> (claimed, written, n). A job's buffers stay held (exported: a
 * NumPy array cannot be resized, an mmap not closed) until query, synchronize or wait
 * first finds it done, or until it is freed, which waits for it first. pool.close(): the
 * threads finish the queued jobs and end (joined, the GIL released); start raises after it. A pool's threads touch
 * no Python object: queued jobs hold their buffers, and the pool holds no reference
 * to a job (a job holds one to its pool, so a pool is freed after its jobs).
 * Fork: a child process has none of the parent's threads; start raises there, and a
 * pool made in another process is neither joined nor its lock touched when freed. */

typedef struct JobObject JobObject;

/* What a thread claims of a job at a time: up to POOL_BLOCK_ROWS rows of up to
 * POOL_BLOCK_BYTES of output together (at least one row): small enough that a waiter
 * shares a consumer's chunk (1,024 rows, up to 16 MiB) with the pool and that a timed
 * wait overruns by little (a block: tens of µs), large enough that the claims (a lock
 * each) and the prefetch's start cost nothing beside the rows. */
#define POOL_BLOCK_ROWS 32
#define POOL_BLOCK_BYTES (256 << 10)

/* Tests only (_pause_starts): how long each Pool.start waits, the GIL released, before it
 * queues its job, so that a close in another thread lands inside the start. */
static struct timespec start_pause;

/* The clock of a timed wait for a job (job.wait): pool->done's. */
#if defined(CLOCK_MONOTONIC) && !defined(__APPLE__)
#define POOL_MONOTONIC 1
#define POOL_CLOCK CLOCK_MONOTONIC
#else
#define POOL_CLOCK CLOCK_REALTIME
#endif

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t work; /* a job queued, or closing */
    pthread_cond_t done; /* a job ran */
    JobObject *head, *tail; /* queued (rows unclaimed), in order */
    Py_ssize_t threads, started;
    pthread_t *tids;
    int closing, joined;
    int stream; /* the calls started from now on write float32 lines around the caches */
    pid_t pid;
} PoolObject;

struct JobObject {
    PyObject_HEAD
    PoolObject *pool; /* a strong reference */
    JobObject *next;  /* in the queue, under pool->mu */
    RowsCall call;
    Py_ssize_t claimed, finished; /* rows claimed by a thread, rows written: under pool->mu */
    int ran;      /* under pool->mu: every row written (and fenced) */
    int released; /* the buffers let go (the GIL held) */
};

static PyTypeObject PoolType, JobType;

/* Under pool->mu: claim the next block of a queued job's rows, [*lo, *hi); the job leaves
 * the queue once all its rows are claimed. */
static void job_claim(PoolObject *pool, JobObject *job, Py_ssize_t *lo, Py_ssize_t *hi) {
    const Py_ssize_t n = job->call.n, rb = row_bytes(&job->call.sp);
    Py_ssize_t rows = rb > 0 ? POOL_BLOCK_BYTES / rb : POOL_BLOCK_ROWS;
    rows = rows < 1 ? 1 : rows > POOL_BLOCK_ROWS ? POOL_BLOCK_ROWS : rows;
    *lo = job->claimed;
    *hi = n - *lo > rows ? *lo + rows : n;
    job->claimed = *hi;
    if (*hi < n) return;
    JobObject **at = &pool->head, *before = NULL; /* (a queue of a job or two) */
    while (*at != NULL && *at != job) before = *at, at = &(*at)->next;
    if (*at == NULL) return;
    *at = job->next;
    if (pool->tail == job) pool->tail = before;
    job->next = NULL;
}

/* Rows [lo, hi) of a job, claimed: written without pool->mu (held on entry and on
 * return), then counted; the job has run once every row is. */
static void job_run(PoolObject *pool, JobObject *job, Py_ssize_t lo, Py_ssize_t hi) {
    pthread_mutex_unlock(&pool->mu);
    run_rows(&job->call, lo, hi);
    if (job->call.sp.stream) STREAM_FENCE(); /* the streamed lines, before they count */
    pthread_mutex_lock(&pool->mu);
    job->finished += hi - lo;
    if (job->finished == job->call.n) {
        job->ran = 1;
        pthread_cond_broadcast(&pool->done);
    }
}

static void *pool_thread(void *arg) {
    PoolObject *pool = (PoolObject *)arg;
    pthread_mutex_lock(&pool->mu);
    for (;;) {
        while (pool->head == NULL && !pool->closing) pthread_cond_wait(&pool->work, &pool->mu);
        JobObject *job = pool->head;
        if (job == NULL) break; /* closing, and nothing queued */
        pthread_mutex_unlock(&pool->mu);
        /* The job's blocks while it is queued, counted as one GIL-free section (all of a
         * pool thread's time is; a section a job keeps a count bounded by a chunk). The
         * job may be gone once its last block is claimed: only its address is compared. */
        FREE_BEGIN
        pthread_mutex_lock(&pool->mu);
        while (pool->head == job) {
            Py_ssize_t lo, hi;
            job_claim(pool, job, &lo, &hi);
            job_run(pool, job, lo, hi);
        }
        pthread_mutex_unlock(&pool->mu);
        FREE_END
        pthread_mutex_lock(&pool->mu);
    }
    pthread_mutex_unlock(&pool->mu);
    return NULL;
}

static PyObject *pool_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Py_ssize_t threads;
    static char *kwlist[] = {"threads", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n", kwlist, &threads)) return NULL;
    if (threads < 1 || threads > 1024) {
        PyErr_SetString(PyExc_ValueError, "Pool: threads must be 1 to 1024");
        return NULL;
    }
    PoolObject *pool = (PoolObject *)type->tp_alloc(type, 0);
    if (pool == NULL) return NULL;
    pool->tids = PyMem_Calloc((size_t)threads, sizeof(pthread_t));
    if (pool->tids == NULL) {
        Py_DECREF(pool);
        return PyErr_NoMemory();
    }
    pthread_mutex_init(&pool->mu, NULL);
    pthread_cond_init(&pool->work, NULL);
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
#ifdef POOL_MONOTONIC
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
#endif
    pthread_cond_init(&pool->done, &attr);
    pthread_condattr_destroy(&attr);
    pool->threads = threads;
    pool->pid = getpid();
    return (PyObject *)pool;
}

/* Stop the threads once the queue is empty and join them, the GIL released. */
static void pool_join(PoolObject *pool) {
    if (pool->joined || pool->pid != getpid()) return;
    pool->joined = 1;
    Py_BEGIN_ALLOW_THREADS;
    pthread_mutex_lock(&pool->mu);
    pool->closing = 1;
    pthread_cond_broadcast(&pool->work);
    pthread_mutex_unlock(&pool->mu);
    for (Py_ssize_t k = 0; k < pool->started; k++) pthread_join(pool->tids[k], NULL);
    Py_END_ALLOW_THREADS;
}

static void pool_dealloc(PoolObject *pool) {
    if (pool->tids != NULL) { /* made: its lock and conditions exist */
        if (pool->pid == getpid()) {
            pool_join(pool);
            pthread_mutex_destroy(&pool->mu);
            pthread_cond_destroy(&pool->work);
            pthread_cond_destroy(&pool->done);
        }
        PyMem_Free(pool->tids);
    }
    Py_TYPE(pool)->tp_free((PyObject *)pool);
}

static PyObject *pool_close(PoolObject *pool, PyObject *unused) {
    pool_join(pool);
    Py_RETURN_NONE;
}

static PyObject *pool_start(PoolObject *pool, PyObject *args) {
    if (pool->pid != getpid()) {
        PyErr_SetString(PyExc_RuntimeError, "Pool.start: the pool was made in another process "
                                            "(its threads do not exist in this one)");
        return NULL;
    }
    if (pool->joined) {
        PyErr_SetString(PyExc_RuntimeError, "Pool.start: the pool is closed");
        return NULL;
    }
    JobObject *job = (JobObject *)JobType.tp_alloc(&JobType, 0);
    if (job == NULL) return NULL;
    job->released = 1; /* nothing held yet, nothing to wait for */
    job->ran = 1;
    if (parse_call(args, &job->call) < 0) {
        release_call(&job->call);
        Py_DECREF(job);
        return NULL;
    }
    job->call.sp.stream = pool->stream;
    Py_INCREF(pool);
    job->pool = pool;
    int failed = 0, closing = 0;
    /* Queued and signalled without the GIL: waking a sleeping pool thread is a system
     * call (an interrupt to another CPU on a VM), and the woken thread may take this
     * one's CPU; no Python object is touched here (the job's buffers are held). A
     * close that began meanwhile (another thread) refuses the job: its threads may
     * have ended, and none would run it. */
    Py_BEGIN_ALLOW_THREADS;
    FREE_BEGIN
    if (start_pause.tv_sec | start_pause.tv_nsec) nanosleep(&start_pause, NULL);
    pthread_mutex_lock(&pool->mu);
    if (pool->closing) {
        closing = failed = 1;
    } else if (pool->started < pool->threads) { /* a thread a job, up to `threads` */
        if (pthread_create(&pool->tids[pool->started], NULL, pool_thread, pool) == 0)
            pool->started++;
        else if (pool->started == 0)
            failed = 1;
    }
    if (!failed) {
        job->ran = 0;
        job->released = 0;
        job->claimed = job->finished = 0;
        if (pool->tail != NULL) pool->tail->next = job;
        else pool->head = job;
        pool->tail = job;
        pthread_cond_signal(&pool->work);
    }
    pthread_mutex_unlock(&pool->mu);
    FREE_END
    Py_END_ALLOW_THREADS;
    if (failed) {
        release_call(&job->call); /* (released is set: the job's end lets go of nothing) */
        Py_DECREF(job);
        PyErr_SetString(PyExc_RuntimeError, closing ? "Pool.start: the pool is closed"
                                                    : "Pool.start: no thread could be started");
        return NULL;
    }
    return (PyObject *)job;
}

static int job_ran(JobObject *job) {
    pthread_mutex_lock(&job->pool->mu);
    const int ran = job->ran;
    pthread_mutex_unlock(&job->pool->mu);
    return ran;
}

/* Wait until the job ran (the GIL released), writing its unclaimed blocks meanwhile,
 * then let go of its buffers. */
static void job_wait(JobObject *job) {
    if (job->released) return;
    if (!job_ran(job)) {
        PoolObject *pool = job->pool;
        Py_BEGIN_ALLOW_THREADS;
        FREE_BEGIN
        pthread_mutex_lock(&pool->mu);
        while (!job->ran) {
            if (job->claimed < job->call.n) {
                Py_ssize_t lo, hi;
                job_claim(pool, job, &lo, &hi);
                job_run(pool, job, lo, hi);
            } else {
                pthread_cond_wait(&pool->done, &pool->mu);
            }
        }
        pthread_mutex_unlock(&pool->mu);
        FREE_END
        Py_END_ALLOW_THREADS;
    }
    job->released = 1;
    release_call(&job->call);
}

static PyObject *job_query(JobObject *job, PyObject *unused) {
    if (!job->released) {
        if (!job_ran(job)) Py_RETURN_FALSE;
        job_wait(job);
    }
    Py_RETURN_TRUE;
}

/* job.rows() -> (claimed, written, n): how many of its rows threads have claimed and
 * written (tests: a wait that finds every row claimed waits, writing none). */
static PyObject *job_rows(JobObject *job, PyObject *unused) {
    const int here = job->pool->pid == getpid(); /* (a parent's lock may be held for good) */
    if (here) pthread_mutex_lock(&job->pool->mu);
    const Py_ssize_t claimed = job->claimed, finished = job->finished;
    if (here) pthread_mutex_unlock(&job->pool->mu);
    return Py_BuildValue("nnn", claimed, finished, job->call.n);
}

static PyObject *job_synchronize(JobObject *job, PyObject *unused) {
    job_wait(job);
    Py_RETURN_NONE;
}

/* job.wait(seconds): wait at most `seconds` (>= 0; the GIL released while waiting);
 * True once it ran (its buffers then let go, as after synchronize), else False. */
static PyObject *job_timed_wait(JobObject *job, PyObject *arg) {
    const double seconds = PyFloat_AsDouble(arg);
    if (seconds == -1.0 && PyErr_Occurred()) return NULL;
    if (!(seconds >= 0.0)) { /* NaN too */
        PyErr_SetString(PyExc_ValueError, "Job.wait: seconds must be >= 0");
        return NULL;
    }
    if (job->released) Py_RETURN_TRUE;
    int ran = job_ran(job);
    if (!ran && seconds > 0.0) {
        PoolObject *pool = job->pool;
        struct timespec deadline;
        clock_gettime(POOL_CLOCK, &deadline);
        const double capped = seconds < 1e9 ? seconds : 1e9; /* no overflow of tv_sec */
        const time_t whole = (time_t)capped;                 /* (truncated: >= 0) */
        deadline.tv_sec += whole;
        deadline.tv_nsec += (long)((capped - (double)whole) * 1e9);
        if (deadline.tv_nsec >= 1000000000L) {
            deadline.tv_sec += 1;
            deadline.tv_nsec -= 1000000000L;
        }
        Py_BEGIN_ALLOW_THREADS;
        FREE_BEGIN
        pthread_mutex_lock(&pool->mu);
        while (!job->ran) {
            if (job->claimed < job->call.n) { /* a block, then the time is looked at */
                Py_ssize_t lo, hi;
                job_claim(pool, job, &lo, &hi);
                job_run(pool, job, lo, hi);
                struct timespec now;
                clock_gettime(POOL_CLOCK, &now);
                if (now.tv_sec > deadline.tv_sec ||
                    (now.tv_sec == deadline.tv_sec && now.tv_nsec >= deadline.tv_nsec))
                    break;
            } else if (pthread_cond_timedwait(&pool->done, &pool->mu, &deadline) == ETIMEDOUT) {
                break;
            }
        }
        ran = job->ran;
        pthread_mutex_unlock(&pool->mu);
        FREE_END
        Py_END_ALLOW_THREADS;
    }
    if (!ran) Py_RETURN_FALSE;
    job_wait(job);
    Py_RETURN_TRUE;
}

static void job_dealloc(JobObject *job) {
    if (job->pool != NULL) {
        if (job->pool->pid == getpid()) job_wait(job);
        else job->released = 1; /* a parent's job: its thread is not here; never freed */
        Py_CLEAR(job->pool);
    } else {
        release_call(&job->call);
    }
    Py_TYPE(job)->tp_free((PyObject *)job);
}

static PyMethodDef pool_methods[] = {
    {"start", (PyCFunction)pool_start, METH_VARARGS,
     "start(*transform_rows arguments) -> Job: the call checked now and run by a pool "
     "thread."},
    {"close", (PyCFunction)pool_close, METH_NOARGS,
     "Finish the queued jobs and join the threads (the GIL released); idempotent."},
    {NULL, NULL, 0, NULL},
};

static PyMethodDef job_methods[] = {
    {"query", (PyCFunction)job_query, METH_NOARGS, "Whether the job ran."},
    {"synchronize", (PyCFunction)job_synchronize, METH_NOARGS,
     "Wait until the job ran, the GIL released, writing blocks no thread claimed yet."},
    {"wait", (PyCFunction)job_timed_wait, METH_O,
     "wait(seconds) -> bool: wait at most `seconds` (the GIL released; for seconds > 0 "
     "writing blocks no thread claimed yet, the time looked at after each); whether it "
     "ran."},
    {"rows", (PyCFunction)job_rows, METH_NOARGS,
     "rows() -> (claimed, written, n): the job's rows claimed by a thread and written."},
    {NULL, NULL, 0, NULL},
};

static PyObject *pool_get_stream(PoolObject *pool, void *unused) {
    (void)unused;
    return PyBool_FromLong(pool->stream);
}

static int pool_set_stream(PoolObject *pool, PyObject *value, void *unused) {
    (void)unused;
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "Pool.stream cannot be deleted");
        return -1;
    }
    const int on = PyObject_IsTrue(value);
    if (on < 0) return -1;
    pool->stream = on;
    return 0;
}

static PyGetSetDef pool_getset[] = {
    {"stream", (getter)pool_get_stream, (setter)pool_set_stream,
     "Whether the calls started from now on write their float32 output lines around the "
     "caches (non-temporal stores, x86-64; lines of whole, aligned cache lines only): "
     "for outputs not read again before more than the caches hold is written. False "
     "when made.",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "blobpipe._io._rowkernel.Pool",
    .tp_basicsize = sizeof(PoolObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Pool(threads): transform_rows calls run by threads that never take the GIL.",
    .tp_new = pool_new,
    .tp_dealloc = (destructor)pool_dealloc,
    .tp_methods = pool_methods,
    .tp_getset = pool_getset,
};

static PyTypeObject JobType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "blobpipe._io._rowkernel.Job",
    .tp_basicsize = sizeof(JobObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A transform_rows call queued on a Pool (Pool.start).",
    .tp_dealloc = (destructor)job_dealloc,
    .tp_methods = job_methods,
};

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
    if (get_buf(src_o, &src, 0, "src") ||
        (mean_o != Py_None && get_buf(mean_o, &mb, 0, "mean")) ||
        get_buf(out_o, &ob, PyBUF_WRITABLE, "out"))
        goto done;
    if (!items_are(&src, "uc", 1, "src", "uint8 (bytes)")) goto done;
    if (make_spec(&sp, C, H, W, crop, hwc, nhwc, &mb, scale, &ob, 1) < 0) goto done;
    if (src.view.len != sp.size) {
        PyErr_Format(PyExc_ValueError, "src must hold the image's C*H*W = %zd pixels, got %zd",
                     sp.size, src.view.len);
        goto done;
    }
    if (!crop_fits(&sp, h0, w0, 0)) goto done;
    float line[3 * STACK_LINE]; /* a mirrored line's scratch; wider lines: in place */
    if (sp.cw <= STACK_LINE) sp.line = line;
    Py_BEGIN_ALLOW_THREADS;
    FREE_BEGIN
    transform_one(&sp, (const uint8_t *)src.view.buf, h0, w0, flip, ob.view.buf);
    FREE_END
    Py_END_ALLOW_THREADS;
    Py_INCREF(Py_None);
    result = Py_None;
done:
    release(&src);
    release(&mb);
    release(&ob);
    return result;
}

static PyObject *file_size(PyObject *self, PyObject *arg) {
    long fd = PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred())
        return NULL;
    if (fd < 0 || fd > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "file_size: not a file descriptor");
        return NULL;
    }
    struct stat st;
    if (fstat((int)fd, &st) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromLongLong((long long)st.st_size);
}

#ifdef __linux__
#include <sys/mman.h>
/* Pages [first, last] of the map at base (count pages long) all in the page cache: one
 * mincore call for a span of up to RESIDENT_SPAN pages (a call costs ~1 us on a VM, a
 * page looked up ~0.2 us), else its first and last pages alone. */
#define RESIDENT_SPAN 32
static int span_resident(uintptr_t base, long page, Py_ssize_t count, Py_ssize_t first,
                         Py_ssize_t last) {
    unsigned char v[RESIDENT_SPAN];
    if (first < 0 || last < first || last >= count) return 0;
    if (last - first < RESIDENT_SPAN) {
        const Py_ssize_t n = last - first + 1;
        if (mincore((void *)(base + (uintptr_t)first * (uintptr_t)page), (size_t)(n * page), v))
            return 0;
        for (Py_ssize_t k = 0; k < n; k++)
            if (!(v[k] & 1)) return 0;
        return 1;
    }
    return span_resident(base, page, count, first, first) &&
           span_resident(base, page, count, last, last);
}

static PyObject *resident(PyObject *self, PyObject *args) {
    PyObject *buf_o, *first_o, *last_o;
    if (!PyArg_ParseTuple(args, "OOO", &buf_o, &first_o, &last_o)) return NULL;
    Buf buf = {0}, first = {0}, last = {0};
    PyObject *result = NULL;
    if (get_buf(buf_o, &buf, 0, "buffer") || get_buf(first_o, &first, 0, "first") ||
        get_buf(last_o, &last, 0, "last"))
        goto done;
    if (!items_are(&first, "i", (Py_ssize_t)sizeof(Py_ssize_t), "first", "intp") ||
        !items_are(&last, "i", (Py_ssize_t)sizeof(Py_ssize_t), "last", "intp"))
        goto done;
    if (first.view.len != last.view.len) {
        PyErr_SetString(PyExc_ValueError, "resident: first and last must be of one length");
        goto done;
    }
    const long page = sysconf(_SC_PAGESIZE);
    const uintptr_t base = (uintptr_t)buf.view.buf;
    if (page <= 0 || base % (uintptr_t)page != 0) {
        PyErr_SetString(PyExc_ValueError, "resident: the buffer must start at a page boundary");
        goto done;
    }
    const Py_ssize_t n = first.view.len / (Py_ssize_t)sizeof(Py_ssize_t);
    const Py_ssize_t count = buf.view.len / page + (buf.view.len % page != 0);
    const Py_ssize_t *f = (const Py_ssize_t *)first.view.buf;
    const Py_ssize_t *l = (const Py_ssize_t *)last.view.buf;
    result = PyBytes_FromStringAndSize(NULL, n);
    if (result == NULL) goto done;
    char *out = PyBytes_AS_STRING(result);
    for (Py_ssize_t i = 0; i < n; i++) out[i] = (char)span_resident(base, page, count, f[i], l[i]);
done:
    release(&buf);
    release(&first);
    release(&last);
    return result;
}
#endif

static PyObject *take(PyObject *self, PyObject *args) {
    PyObject *src_o, *rows_o, *out_o;
    if (!PyArg_ParseTuple(args, "OOO", &src_o, &rows_o, &out_o)) return NULL;
    Buf src = {0}, rows = {0}, out = {0};
    PyObject *result = NULL;
    if (get_buf(src_o, &src, 0, "src") || get_buf(rows_o, &rows, 0, "rows") ||
        get_buf(out_o, &out, PyBUF_WRITABLE, "out"))
        goto done;
    if (!items_are(&rows, "i", (Py_ssize_t)sizeof(Py_ssize_t), "rows", "intp")) goto done;
    const Py_ssize_t size = src.view.itemsize;
    if ((size != 4 && size != 8) || out.view.itemsize != size) {
        PyErr_SetString(PyExc_ValueError, "take: src and out must have items of 4 or 8 bytes, "
                                          "the same in both");
        goto done;
    }
    const Py_ssize_t n = rows.view.len / rows.view.itemsize, m = src.view.len / size;
    if (out.view.len / size != n) {
        PyErr_SetString(PyExc_ValueError, "take: out must have one item per row");
        goto done;
    }
    const Py_ssize_t *at = (const Py_ssize_t *)rows.view.buf;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (at[k] < 0 || at[k] >= m) {
            PyErr_Format(PyExc_IndexError, "take: row %zd is %zd, outside src's %zd items", k,
                         at[k], m);
            goto done;
        }
    }
    if (size == 8) {
        const uint64_t *in = (const uint64_t *)src.view.buf;
        uint64_t *o = (uint64_t *)out.view.buf;
        for (Py_ssize_t k = 0; k < n; k++) o[k] = in[at[k]];
    } else {
        const uint32_t *in = (const uint32_t *)src.view.buf;
        uint32_t *o = (uint32_t *)out.view.buf;
        for (Py_ssize_t k = 0; k < n; k++) o[k] = in[at[k]];
    }
    result = Py_None;
    Py_INCREF(result);
done:
    release(&src);
    release(&rows);
    release(&out);
    return result;
}

/* A side (`side`: a Python int, or one intp per row) as draw reads it: row i's. */
typedef struct {
    Buf buf;
    Py_ssize_t value; /* the one side, where `buf` is not held */
    const Py_ssize_t *each;
} Side;

static int get_side(PyObject *o, Side *s, Py_ssize_t n, const char *name) {
    if (PyLong_Check(o)) {
        s->value = PyLong_AsSsize_t(o);
        return s->value == -1 && PyErr_Occurred() ? -1 : 0;
    }
    if (get_buf(o, &s->buf, 0, name) ||
        !items_are(&s->buf, "i", (Py_ssize_t)sizeof(Py_ssize_t), name, "intp"))
        return -1;
    if (s->buf.view.len / s->buf.view.itemsize != n) {
        PyErr_Format(PyExc_ValueError, "draw: %s must be an int or one per word", name);
        return -1;
    }
    s->each = (const Py_ssize_t *)s->buf.view.buf;
    return 0;
}

/* draw(words, height, width, crop, h_off, w_off, flips): Transform's TRAIN draw of each
 * row's crop and flip from its random word (draw_geometry's arithmetic, in one call):
 * h_off and w_off (writable buffers of n intp, or both None: no crop, crop 0) get
 * ((word >> 1) & 0x7FFFFFFF) % (H - crop + 1) and (word >> 32) % (W - crop + 1); flips
 * (a writable n-byte bool buffer, or None for no mirror) gets bit 0 of the word.
 * height and width: ints, or one intp per word; each at least the crop (checked for
 * every row before anything is written). Keeps the GIL (a batch's words: well under a
 * microsecond). */
static PyObject *draw(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *words_o, *h_o, *w_o, *ho_o, *wo_o, *flip_o;
    Py_ssize_t crop;
    if (!PyArg_ParseTuple(args, "OOOnOOO", &words_o, &h_o, &w_o, &crop, &ho_o, &wo_o, &flip_o))
        return NULL;
    Buf words = {0}, h_off = {0}, w_off = {0}, flips = {0};
    Side hs = {0}, ws = {0};
    PyObject *result = NULL;
    if (get_buf(words_o, &words, 0, "words") || !items_are(&words, "u", 8, "words", "uint64"))
        goto done;
    const Py_ssize_t n = words.view.len / 8;
    if (get_side(h_o, &hs, n, "height") || get_side(w_o, &ws, n, "width")) goto done;
    if ((ho_o == Py_None) != (wo_o == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "draw: h_off and w_off must both be given, or neither");
        goto done;
    }
    if (crop < 0 || (crop == 0) != (ho_o == Py_None)) {
        PyErr_SetString(PyExc_ValueError,
                        "draw: crop must be > 0 with h_off and w_off, 0 without them");
        goto done;
    }
    if (ho_o != Py_None) {
        if (get_buf(ho_o, &h_off, PyBUF_WRITABLE, "h_off") ||
            !items_are(&h_off, "i", (Py_ssize_t)sizeof(Py_ssize_t), "h_off", "intp") ||
            get_buf(wo_o, &w_off, PyBUF_WRITABLE, "w_off") ||
            !items_are(&w_off, "i", (Py_ssize_t)sizeof(Py_ssize_t), "w_off", "intp"))
            goto done;
        if (h_off.view.len / h_off.view.itemsize != n || w_off.view.len / w_off.view.itemsize != n) {
            PyErr_SetString(PyExc_ValueError, "draw: h_off and w_off must be one per word");
            goto done;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            const Py_ssize_t H = hs.each ? hs.each[i] : hs.value, W = ws.each ? ws.each[i] : ws.value;
            if (H < crop || W < crop) {
                PyErr_Format(PyExc_ValueError,
                             "draw: row %zd's %zdx%zd is smaller than the crop %zd", i, H, W, crop);
                goto done;
            }
        }
    }
    if (flip_o != Py_None) {
        if (get_buf(flip_o, &flips, PyBUF_WRITABLE, "flips") ||
            !items_are(&flips, "?u", 1, "flips", "bool or uint8"))
            goto done;
        if (flips.view.len != n) {
            PyErr_SetString(PyExc_ValueError, "draw: flips must be one per word");
            goto done;
        }
    }
    const uint64_t *w = (const uint64_t *)words.view.buf;
    if (h_off.held) {
        Py_ssize_t *ho = (Py_ssize_t *)h_off.view.buf, *wo = (Py_ssize_t *)w_off.view.buf;
        for (Py_ssize_t i = 0; i < n; i++) {
            const Py_ssize_t H = hs.each ? hs.each[i] : hs.value, W = ws.each ? ws.each[i] : ws.value;
            /* H - crop + 1 >= 1 for every side checked above; unsigned, and a zero
             * divisor guarded, for an output that overlaps a side (which its writes may
             * then have changed): wrong offsets, never a trap */
            const uint64_t rh = (uint64_t)H - (uint64_t)crop + 1u;
            const uint64_t rw = (uint64_t)W - (uint64_t)crop + 1u;
            ho[i] = rh ? (Py_ssize_t)(((w[i] >> 1) & 0x7FFFFFFFu) % rh) : 0;
            wo[i] = rw ? (Py_ssize_t)((w[i] >> 32) % rw) : 0;
        }
    }
    if (flips.held) {
        uint8_t *f = (uint8_t *)flips.view.buf;
        for (Py_ssize_t i = 0; i < n; i++) f[i] = (uint8_t)(w[i] & 1u);
    }
    result = Py_None;
    Py_INCREF(result);
done:
    release(&words);
    release(&hs.buf);
    release(&ws.buf);
    release(&h_off);
    release(&w_off);
    release(&flips);
    return result;
}

/* Record [p, p + len): 1 and *label where it is header, `size` pixels and the raw
 * layout's tail (match_raw's comment); else 0. */
static int raw_layout(const uint8_t *p, Py_ssize_t len, const uint8_t *header, Py_ssize_t hl,
                      Py_ssize_t size, int32_t *label) {
    const Py_ssize_t k = len - hl - size; /* the tail's bytes */
    if (k < 2 || k > 14 || memcmp(p, header, (size_t)hl) != 0) return 0;
    const uint8_t *t = p + hl + size;
    if (t[0] != 0x28) return 0;
    /* the label's varint: bytes 1 .. k-3 when 0x38 0x00 ends the record, else 1 .. k-1 */
    for (int with_enc = 1; with_enc >= 0; with_enc--) {
        const Py_ssize_t n = with_enc ? k - 3 : k - 1;
        if (n < 1 || n > 10) continue;
        if (with_enc && (t[k - 2] != 0x38 || t[k - 1] != 0x00)) continue;
        uint64_t v = 0;
        int ok = 1;
        for (Py_ssize_t j = 0; j < n; j++) {
            const uint8_t b = t[1 + j];
            if ((j == n - 1) != (b < 0x80)) {
                ok = 0;
                break;
            }
            v |= (uint64_t)(b & 0x7F) << (7 * j);
        }
        if (!ok) continue;
        *label = (int32_t)(uint32_t)(v & 0xFFFFFFFFu);
        return 1;
    }
    return 0;
}

static PyObject *match_raw(PyObject *self, PyObject *args) {
    PyObject *buf_o, *off_o, *len_o, *good_o, *lab_o;
    const char *header;
    Py_ssize_t hl, size;
    if (!PyArg_ParseTuple(args, "OOOy#nOO", &buf_o, &off_o, &len_o, &header, &hl, &size, &good_o,
                          &lab_o))
        return NULL;
    Buf buf = {0}, off = {0}, lens = {0}, good = {0}, lab = {0};
    PyObject *result = NULL;
    if (get_buf(buf_o, &buf, 0, "buffer") || get_buf(off_o, &off, 0, "offsets") ||
        get_buf(len_o, &lens, 0, "lengths") || get_buf(good_o, &good, PyBUF_WRITABLE, "good") ||
        get_buf(lab_o, &lab, PyBUF_WRITABLE, "labels"))
        goto done;
    if (!items_are(&buf, "uc", 1, "buffer", "uint8 (bytes)") ||
        !items_are(&off, "i", 8, "offsets", "int64") ||
        !items_are(&lens, "i", 8, "lengths", "int64") ||
        !items_are(&good, "?u", 1, "good", "bool or uint8") ||
        !items_are(&lab, "i", 4, "labels", "int32"))
        goto done;
    const Py_ssize_t n = off.view.len / 8;
    if (lens.view.len / 8 != n || good.view.len != n || lab.view.len / 4 != n) {
        PyErr_SetString(PyExc_ValueError,
                        "match_raw: offsets, lengths, good and labels must be one per record");
        goto done;
    }
    if (size < 0 || hl > PY_SSIZE_T_MAX - size - 14) {
        PyErr_SetString(PyExc_ValueError, "match_raw: bad size");
        goto done;
    }
    const int64_t *at = (const int64_t *)off.view.buf, *len = (const int64_t *)lens.view.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (at[i] < 0 || len[i] < 0 || at[i] > buf.view.len || len[i] > buf.view.len - at[i]) {
            PyErr_Format(PyExc_ValueError, "match_raw: record %zd lies outside the buffer", i);
            goto done;
        }
    }
    const uint8_t *base = (const uint8_t *)buf.view.buf, *h = (const uint8_t *)header;
    uint8_t *g = (uint8_t *)good.view.buf;
    int32_t *labels = (int32_t *)lab.view.buf;
    Py_ssize_t count = 0;
    Py_BEGIN_ALLOW_THREADS;
    FREE_BEGIN
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t label = 0;
        g[i] = (uint8_t)raw_layout(base + at[i], (Py_ssize_t)len[i], h, hl, size, &label);
        labels[i] = label;
        count += g[i];
    }
    FREE_END
    Py_END_ALLOW_THREADS;
    result = PyLong_FromSsize_t(count);
done:
    release(&buf);
    release(&off);
    release(&lens);
    release(&good);
    release(&lab);
    return result;
}

static PyObject *pause_starts(PyObject *self, PyObject *arg) {
    (void)self;
    const double seconds = PyFloat_AsDouble(arg);
    if (seconds == -1.0 && PyErr_Occurred()) return NULL;
    if (!(seconds >= 0.0 && seconds <= 10.0)) {
        PyErr_SetString(PyExc_ValueError, "_pause_starts: seconds must be 0 to 10");
        return NULL;
    }
    start_pause.tv_sec = (time_t)seconds;
    start_pause.tv_nsec = (long)((seconds - (double)start_pause.tv_sec) * 1e9);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"_pause_starts", pause_starts, METH_O,
     "Tests only: each Pool.start waits this many seconds (the GIL released) before it "
     "queues its job; 0 (the default): none."},
    {"transform_rows", transform_rows, METH_VARARGS,
     "Caffe's transform of raw (C, H, W) uint8 rows of one buffer (see the module source)."},
    {"transform_image", transform_image, METH_VARARGS,
     "Caffe's transform of one uint8 image, (C, H, W) or (H, W, C) (see the module source)."},
    {"draw", draw, METH_VARARGS,
     "Each row's TRAIN crop offsets and flip from its random word (see the module source)."},
    {"take", take, METH_VARARGS,
     "src[rows] into out, for items of 4 or 8 bytes, without releasing the GIL."},
#ifdef __linux__
    {"resident", resident, METH_VARARGS,
     "Which spans of pages of a file's map are in the page cache (mincore), the GIL kept."},
#endif
    {"file_size", file_size, METH_O,
     "The length of the open file descriptor's file (fstat), without releasing the GIL."},
    {"match_raw", match_raw, METH_VARARGS,
     "Which records are raw Datums of one shape in convert_imageset's layout, and their "
     "labels (see the module source)."},
    FREE_CPU_METHOD,
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rowkernel", NULL, -1, methods};

PyMODINIT_FUNC PyInit__rowkernel(void) {
    if (PyType_Ready(&PoolType) < 0 || PyType_Ready(&JobType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&PoolType);
    if (PyModule_AddObject(m, "Pool", (PyObject *)&PoolType) < 0) {
        Py_DECREF(&PoolType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
