/* The fused statistics kernel for float32 values on the CPU (lightning_hooks.stats.accumulate_).
 *
 * The tensor-op kernel in stats.py makes about thirty passes over the values (each op reads
 * and writes the whole tensor); this one reads them from memory once: it takes them in blocks
 * that stay in the L1 cache while three passes run over each (moments, histogram, squared
 * deviations). It reads contiguous CPU tensors through the buffer protocol (their numpy views;
 * _native.py registers it as the torch custom op lightning_hooks::accumulate_f32), checks their
 * formats and lengths, and releases the GIL; a large tensor is split over as many threads as
 * torch uses for its own CPU ops (at most 16).
 *
 * The row layout (column indices below) is that of _stat_rows.SUM_FIELDS + MAX_FIELDS, then
 * the histogram counts; tests/test_cstats.py checks both kernels agree on every column.
 *
 * Bins: a table indexed by a value's sign, exponent and top four mantissa bits (cells of 1/16
 * octave) gives the lowest bin of the cell and that bin's right edge. Where no cell holds more
 * than one edge (the default bins: a bin spans 0.65 octave) one comparison with that edge
 * finishes; otherwise the bin steps up across edges. Either way the result equals
 * torch.bucketize on the same float32 edges: bin k holds edges[k] < x <= edges[k + 1].
 *
 * Vectors are GCC/Clang vector extensions: SSE2 on x86-64 (and AVX2 where the CPU has it), NEON
 * on arm64, scalar elsewhere.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifndef _WIN32
#include <pthread.h>
#endif

enum { COUNT, FINITE, SUM, SUM_SQ, ZEROS, NAN_COUNT, POSINF, NEGINF, CALLS, MAX, NEG_MIN, N_FIELDS };

#define TABLE_SHIFT 19 /* 32 - (1 sign + 8 exponent + 4 mantissa bits) */
#define EXPONENT 0x7f800000
#define IS_FINITE(b) (((b) & EXPONENT) != EXPONENT) /* an exponent of all ones is Inf or NaN */
#define BLOCK 4096
#define COPIES 4 /* histogram copies: a run of equal values (a ReLU's zeros) need not wait on itself */
#define MIN_PER_THREAD (1 << 17) /* values; fewer are not worth a thread's start (~20 us) */
#define MAX_THREADS 16 /* threads started per call: beyond this memory bandwidth, not cores, limits */

typedef struct {
    int32_t bin;  /* the lowest bin of the cell */
    float edge;   /* that bin's right edge */
} Cell;

typedef struct {
    int64_t n_finite, zeros, nan, posinf, neginf;
    double mean, m2; /* of the finite values so far: mean, sum of squared deviations from it */
    float lo, hi;
} Totals;

#define W 4
#define TARGET
#include "_cstats_passes.h"

/* AVX2 versions of the vectorised passes, used where the CPU has AVX2 (checked at import). */
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__)) && !defined(NO_AVX2)
#define HAVE_AVX2_PASSES 1
#define W 8
#define TARGET __attribute__((target("avx2")))
#include "_cstats_passes.h"
#else
#define block_moments_w8 block_moments_w4
#define block_deviations_w8 block_deviations_w4
#endif
static int use_avx2 = 0; /* set at import; a test can switch it to check both versions agree */

/* Pass 2: histogram counts; with has_bad, also the kinds of the non-finite values. */
static void block_histogram(const float *x, int64_t n, int has_bad, int fine, const Cell *table,
                            const float *right, int64_t n_bins, int64_t *counts, Totals *t) {
    int64_t i = 0;
    if (fine && !has_bad) { /* the common case, kept free of branches */
        for (; i + 16 <= n; i += 16) {
            /* The next block comes from memory meanwhile, a cache line (16 values) at a time;
             * a prefetch past the end of the values is harmless: it never faults. */
            __builtin_prefetch((const void *)((uintptr_t)(x + i) + BLOCK * sizeof(float)));
            for (int j = 0; j < 16; j++) {
                uint32_t b;
                memcpy(&b, x + i + j, sizeof b); /* the float's bits (a plain load, without aliasing) */
                Cell c = table[b >> TABLE_SHIFT];
                counts[(j % COPIES) * n_bins + c.bin + (x[i + j] > c.edge)]++;
            }
        }
    }
    for (; i < n; i++) {
        uint32_t b;
        memcpy(&b, x + i, sizeof b);
        if (!IS_FINITE(b)) {
            if (b & 0x007fffffu) t->nan++;
            else if (b >> 31) t->neginf++;
            else t->posinf++;
            continue;
        }
        float v = x[i];
        Cell c = table[b >> TABLE_SHIFT];
        int32_t k = c.bin + (v > c.edge);
        while (v > right[k]) k++;
        counts[(i % COPIES) * n_bins + k]++;
    }
}

/* Chan, Golub and LeVeque's pairwise update: fold k finite values of the given mean and sum
 * of squared deviations into the totals. */
static void merge_moments(Totals *t, int64_t k, double mean, double m2) {
    if (k == 0) return;
    double total = (double)(t->n_finite + k), delta = mean - t->mean;
    t->mean += delta * (double)k / total;
    t->m2 += m2 + delta * delta * (double)t->n_finite * (double)k / total;
    t->n_finite += k;
}

typedef struct {
    const float *x;
    int64_t n, n_bins;
    const Cell *table;
    const float *right;
    int fine, avx2; /* avx2: read once per call, so that set_avx2 cannot change it mid-call */
    Totals t;
    int64_t *counts; /* n_bins * COPIES */
} Job;

/* The statistics of one contiguous range, block by block, into job->t and job->counts. */
static void *run_job(void *arg) {
    Job *job = (Job *)arg;
    Totals *t = &job->t;
    const float *x = job->x;
    for (int64_t start = 0; start < job->n; start += BLOCK) {
        int64_t m = job->n - start < BLOCK ? job->n - start : BLOCK;
        float sum;
        int64_t k = job->avx2 ? block_moments_w8(x + start, m, &sum, t) : block_moments_w4(x + start, m, &sum, t);
        block_histogram(x + start, m, k < m, job->fine, job->table, job->right, job->n_bins, job->counts, t);
        if (k == 0) continue;
        /* A float, so that the non-finite values, which pass 3 takes as the estimate, deviate by
         * exactly 0; and 0 where the float sum of huge values overflowed. */
        float guess = sum / (float)k;
        double estimate = isfinite(guess) ? (double)guess : 0.0, dev, dev_sq;
        (job->avx2 ? block_deviations_w8 : block_deviations_w4)(x + start, m, estimate, &dev, &dev_sq);
        merge_moments(t, k, estimate + dev / (double)k, dev_sq - dev * dev / (double)k);
    }
    return NULL;
}

/* Split n values over up to `threads` threads (the caller's included), at block boundaries,
 * then merge the ranges' totals in order. Returns 0, or -1 when out of memory. */
static int accumulate_f32(const float *x, int64_t n, double *row, int64_t n_bins, const Cell *table,
                          const float *right, int fine, double calls, int threads) {
    int64_t most = n / MIN_PER_THREAD;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    int jobs = threads < 1 ? 1 : (most < threads ? (most < 1 ? 1 : (int)most) : threads);
#ifdef _WIN32
    jobs = 1;
#endif
    int64_t chunk = ((n + jobs - 1) / jobs + BLOCK - 1) / BLOCK * BLOCK;
    if (chunk > 0) jobs = (int)((n + chunk - 1) / chunk); /* rounding up to blocks can leave the last empty */
    if (jobs < 1) jobs = 1;
    int avx2 = use_avx2;
    Job *job = (Job *)calloc((size_t)jobs, sizeof(Job));
    int64_t *counts = (int64_t *)calloc((size_t)(jobs * n_bins * COPIES), sizeof(int64_t));
    if (job == NULL || counts == NULL) {
        free(job), free(counts);
        return -1;
    }
    for (int j = 0; j < jobs; j++) {
        int64_t start = chunk * j < n ? chunk * j : n, stop = chunk * (j + 1) < n ? chunk * (j + 1) : n;
        Job init = {x + start, stop - start, n_bins, table, right, fine, avx2,
                    {0, 0, 0, 0, 0, 0.0, 0.0, INFINITY, -INFINITY}, counts + j * n_bins * COPIES};
        job[j] = init;
    }
#ifndef _WIN32
    pthread_t *thread = (pthread_t *)calloc((size_t)jobs, sizeof(pthread_t));
    int *started = (int *)calloc((size_t)jobs, sizeof(int));
    for (int j = 1; thread != NULL && started != NULL && j < jobs; j++)
        started[j] = pthread_create(&thread[j], NULL, run_job, &job[j]) == 0;
    run_job(&job[0]);
    for (int j = 1; j < jobs; j++) {
        if (thread != NULL && started != NULL && started[j]) pthread_join(thread[j], NULL);
        else run_job(&job[j]); /* no thread for it: do it here */
    }
    free(thread), free(started);
#else
    run_job(&job[0]);
#endif
    Totals t = job[0].t;
    for (int j = 1; j < jobs; j++) {
        const Totals *u = &job[j].t;
        merge_moments(&t, u->n_finite, u->mean, u->m2);
        t.zeros += u->zeros, t.nan += u->nan, t.posinf += u->posinf, t.neginf += u->neginf;
        t.lo = u->lo < t.lo ? u->lo : t.lo;
        t.hi = u->hi > t.hi ? u->hi : t.hi;
    }
    double nf = (double)t.n_finite;
    row[COUNT] += (double)n;
    row[FINITE] += nf;
    row[SUM] += nf * t.mean;
    row[SUM_SQ] += t.m2 + nf * t.mean * t.mean;
    row[ZEROS] += (double)t.zeros;
    row[NAN_COUNT] += (double)t.nan;
    row[POSINF] += (double)t.posinf;
    row[NEGINF] += (double)t.neginf;
    row[CALLS] += calls;
    if (t.n_finite > 0) {
        if ((double)t.hi > row[MAX]) row[MAX] = (double)t.hi;
        if (-(double)t.lo > row[NEG_MIN]) row[NEG_MIN] = -(double)t.lo;
    }
    double *hist = row + N_FIELDS;
    for (int64_t k = 0; k < n_bins; k++) {
        int64_t c = 0;
        for (int64_t copy = 0; copy < jobs * COPIES; copy++) c += counts[copy * n_bins + k];
        hist[k] += (double)c;
    }
    free(job), free(counts);
    return 0;
}

/* A C-contiguous buffer of `what`, with items of `size` bytes of format `code` (in native byte
 * order: "f", "@f" or "=f"); `also` is a second code accepted (int32 is "l" where long is 32 bits). */
static int get_buffer(PyObject *obj, Py_buffer *view, int flags, const char *what, char code, char also,
                      Py_ssize_t size) {
    if (PyObject_GetBuffer(obj, view, flags | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Format(PyExc_TypeError, "accumulate_f32: `%s` must be a C-contiguous%s buffer (a numpy array),"
                     " got %.100s", what, flags & PyBUF_WRITABLE ? ", writable" : "", Py_TYPE(obj)->tp_name);
        return -1;
    }
    const char *f = view->format != NULL ? view->format : "B";
    if (f[0] == '@' || f[0] == '=') f++;
    if (view->itemsize != size || (f[0] != code && f[0] != also) || f[1] != '\0') {
        PyErr_Format(PyExc_TypeError, "accumulate_f32: `%s` must hold %zd-byte items of format '%c', got format"
                     " '%s' of %zd bytes", what, size, code, view->format != NULL ? view->format : "B",
                     view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* accumulate_f32(values, row, table, right, fine, calls, threads): the buffers are read and checked
 * here, so no address crosses from Python, and a row too short for the bins is refused. */
static PyObject *py_accumulate_f32(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objects[4];
    int fine, threads, status = -2;
    double calls;
    if (!PyArg_ParseTuple(args, "OOOOpdi", &objects[0], &objects[1], &objects[2], &objects[3], &fine, &calls,
                          &threads))
        return NULL;
    Py_buffer views[4];
    static const char *names[4] = {"values", "row", "table", "right"};
    static const char codes[4] = {'f', 'd', 'i', 'f'};
    const char int32_also = sizeof(long) == 4 ? 'l' : 'i';
    int held = 0;
    for (; held < 4; held++) {
        int flags = held == 1 ? PyBUF_WRITABLE : PyBUF_SIMPLE;
        char also = held == 2 ? int32_also : codes[held];
        if (get_buffer(objects[held], &views[held], flags, names[held], codes[held], also, held == 1 ? 8 : 4) < 0)
            break;
    }
    if (held == 4) {
        Py_ssize_t n = views[0].len / 4, n_bins = views[3].len / 4, row_len = views[1].len / 8;
        if (n_bins < 1 || row_len != N_FIELDS + n_bins || views[2].len != (Py_ssize_t)sizeof(Cell) << 13) {
            PyErr_Format(PyExc_ValueError, "accumulate_f32: expected a row of %d + n_bins values, a table of"
                         " 8192 cells (2 int32 each) and n_bins >= 1 right edges; got a row of %zd, a table of"
                         " %zd bytes and %zd edges", N_FIELDS, row_len, views[2].len, n_bins);
        } else {
            Py_BEGIN_ALLOW_THREADS
            status = accumulate_f32((const float *)views[0].buf, (int64_t)n, (double *)views[1].buf,
                                    (int64_t)n_bins, (const Cell *)views[2].buf, (const float *)views[3].buf,
                                    fine, calls, threads);
            Py_END_ALLOW_THREADS
        }
    }
    for (int j = 0; j < held; j++) PyBuffer_Release(&views[j]);
    if (status == -1) return PyErr_NoMemory();
    if (status != 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_set_avx2(PyObject *self, PyObject *args) {
    (void)self;
    int on, before = use_avx2;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
#ifdef HAVE_AVX2_PASSES
    use_avx2 = on && __builtin_cpu_supports("avx2");
#endif
    return PyBool_FromLong(before);
}

static PyMethodDef methods[] = {
    {"accumulate_f32", py_accumulate_f32, METH_VARARGS,
     "accumulate_f32(values, row, table, right, fine, calls, threads): add the statistics of the float32 "
     "buffer `values` into the float64 stat row buffer `row` (writable), with the bin table and right edges "
     "of Binning, on up to `threads` threads. Buffers are C-contiguous numpy arrays (torch's Tensor.numpy())."},
    {"set_avx2", py_set_avx2, METH_VARARGS,
     "set_avx2(on): use the AVX2 passes (where the CPU has AVX2) or the baseline ones; returns the previous "
     "setting."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cstats", NULL, -1, methods, NULL, NULL, NULL, NULL};

/* Raised with every change of accumulate_f32's arguments: stats.py ignores a stale build. */
#define ABI_VERSION 5

PyMODINIT_FUNC PyInit__cstats(void) {
#ifdef HAVE_AVX2_PASSES
    __builtin_cpu_init();
    use_avx2 = __builtin_cpu_supports("avx2") != 0;
#endif
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "ABI_VERSION", ABI_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
