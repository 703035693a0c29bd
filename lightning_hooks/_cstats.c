/* One fused pass over float32 values on the CPU for lightning_hooks.stats.accumulate_.
 *
 * The tensor-op kernel in stats.py makes about thirty passes over the values (each op reads
 * and writes the whole tensor); this one reads them twice: once for the counts, the sum, the
 * extremes and the histogram, once for the squared deviations from the mean. It is called
 * with raw addresses of contiguous CPU tensors (no Python objects cross), and releases the
 * GIL while it runs.
 *
 * The row layout (column indices below) is that of stats.SUM_FIELDS + stats.MAX_FIELDS, then
 * the histogram counts; tests/test_stats.py checks that both agree on every column.
 *
 * The bin of a finite value starts from a guess read from a table indexed by the value's sign,
 * exponent and top four mantissa bits (a cell is 1/16 of an octave, narrower than a default
 * bin), then moves across edges until left[k] < x <= right[k]: so the result equals
 * torch.bucketize on the same float32 edges for any increasing edges.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { COUNT, FINITE, SUM, SUM_SQ, ZEROS, NAN_COUNT, POSINF, NEGINF, CALLS, MAX, NEG_MIN, N_FIELDS };

#define TABLE_SHIFT 19 /* 32 - (1 sign + 8 exponent + 4 mantissa bits) */

static void accumulate_f32(const float *x, int64_t n, double *row, int64_t n_bins, const int32_t *table,
                           const float *left, const float *right, double calls, int64_t *counts) {
    const uint32_t *bits = (const uint32_t *)x;
    int64_t n_nan = 0, n_posinf = 0, n_neginf = 0, n_zero = 0;
    double sum = 0.0;
    float lo = INFINITY, hi = -INFINITY;
    memset(counts, 0, (size_t)n_bins * sizeof(int64_t));
    for (int64_t i = 0; i < n; i++) {
        uint32_t b = bits[i];
        if ((b & 0x7f800000u) == 0x7f800000u) { /* exponent all ones: Inf or NaN */
            if (b & 0x007fffffu) n_nan++;
            else if (b >> 31) n_neginf++;
            else n_posinf++;
            continue;
        }
        float v = x[i];
        sum += (double)v;
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
        n_zero += (v == 0.0f);
        int32_t k = table[b >> TABLE_SHIFT];
        while (v > right[k]) k++;
        while (v <= left[k]) k--;
        counts[k]++;
    }
    int64_t n_finite = n - n_nan - n_posinf - n_neginf;
    /* Second pass: deviations from the mean, exact however far the mean is from zero. */
    double mean = n_finite > 0 ? sum / (double)n_finite : 0.0, dev = 0.0, dev_sq = 0.0;
    for (int64_t i = 0; i < n; i++) {
        if ((bits[i] & 0x7f800000u) == 0x7f800000u) continue;
        double d = (double)x[i] - mean;
        dev += d;
        dev_sq += d * d;
    }
    row[COUNT] += (double)n;
    row[FINITE] += (double)n_finite;
    row[SUM] += (double)n_finite * mean + dev;
    row[SUM_SQ] += dev_sq + 2.0 * mean * dev + (double)n_finite * mean * mean;
    row[ZEROS] += (double)n_zero;
    row[NAN_COUNT] += (double)n_nan;
    row[POSINF] += (double)n_posinf;
    row[NEGINF] += (double)n_neginf;
    row[CALLS] += calls;
    if (n_finite > 0) {
        if ((double)hi > row[MAX]) row[MAX] = (double)hi;
        if (-(double)lo > row[NEG_MIN]) row[NEG_MIN] = -(double)lo;
    }
    double *hist = row + N_FIELDS;
    for (int64_t k = 0; k < n_bins; k++) hist[k] += (double)counts[k];
}

static PyObject *py_accumulate_f32(PyObject *self, PyObject *args) {
    Py_ssize_t x, n, row, n_bins, table, left, right;
    double calls;
    if (!PyArg_ParseTuple(args, "nnnnnnnd", &x, &n, &row, &n_bins, &table, &left, &right, &calls)) return NULL;
    if (n < 0 || n_bins < 1) {
        PyErr_SetString(PyExc_ValueError, "accumulate_f32: n must be >= 0 and n_bins >= 1");
        return NULL;
    }
    int64_t *counts = (int64_t *)malloc((size_t)n_bins * sizeof(int64_t));
    if (counts == NULL) return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS
    accumulate_f32((const float *)x, (int64_t)n, (double *)row, (int64_t)n_bins, (const int32_t *)table,
                   (const float *)left, (const float *)right, calls, counts);
    Py_END_ALLOW_THREADS
    free(counts);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"accumulate_f32", py_accumulate_f32, METH_VARARGS,
     "accumulate_f32(x, n, row, n_bins, table, left, right, calls): add the statistics of n contiguous float32 "
     "values at address x into the float64 stat row at address row."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cstats", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cstats(void) { return PyModule_Create(&module); }
