/* Fused passes over parameters for the update ratio ||w_after - w_before|| / ||w_before|| on the CPU.
 *
 * The tensor-op form makes five passes over the rows it measures: the copy of w_before (read
 * and write), the norm of that copy (read), w_after - w_before (two reads, a write, and a
 * fresh buffer unless the copy may be overwritten), and the norm of the difference (read).
 * Here two: copy_squares copies each parameter into its buffer and adds up the squares of
 * the values it moves, in the same read; diff_squares reads w_after and w_before once each
 * and adds up the squares of their differences, which are never stored. squares is the
 * norm pass alone (a copy someone else made). chain_squares is diff_squares that also moves
 * w_after into the buffer of w_before and sums its squares, as copy_squares would at the next
 * step's copy (the same sums, bit for bit): when the parameters do not move between two measured
 * steps, that step needs no copy (three passes a step where copy and update take four).
 *
 * Sums are float64, each value widened exactly to float64 first (float32, float16 and
 * bfloat16 values are exact in float64; so is a float32 difference's square up to its one
 * rounding). Each tensor is cut into chunks of CHUNK values, summed in LANES partial sums
 * each, and the chunks' sums are added in order: the result does not depend on the threads.
 *
 * Tensors come as C-contiguous buffers (numpy views of the tensors, zero copy): format 'f'
 * float32, 'd' float64, 'e' float16, and 'h' or 'H' (an int16 view) bfloat16. A large total is
 * split over up to `threads` threads (at most 16), at chunk boundaries.
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

enum { F32, F64, F16, BF16 };
enum { COPY, DIFF, NORM, CHAIN };

#define CHUNK (1 << 16)          /* values per work item */
#define MIN_PER_THREAD (1 << 17) /* values; fewer are not worth a thread's start */
#define MAX_THREADS 16
#define LANES 8
#define BLOCK 1024 /* values: CHAIN's two loops over a block, the second from the L1 cache (a multiple of LANES) */

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

#include "_cupdate_passes.h"

typedef struct {
    char *first;  /* COPY: the destination; DIFF, CHAIN: w_after; NORM: the values */
    char *second; /* COPY: the source; DIFF: w_before; CHAIN: w_before, overwritten by w_after */
    int kind, size;
} Item;

typedef struct {
    const Item *item;
    int64_t start, n; /* in values */
} Chunk;

typedef struct {
    const Chunk *chunks;
    double *sums; /* two per chunk: its sum, and CHAIN's squares moved */
    int64_t first, last; /* chunks [first, last) */
    int mode;
} Job;

static double run_chunk(const Chunk *c, int mode, double *moved) {
    const Item *it = c->item;
    char *p = it->first + c->start * it->size;
    char *q = it->second == NULL ? NULL : it->second + c->start * it->size;
#define DISPATCH(NAME, T)                                                              \
    return mode == COPY ? NAME##_copy((T *)p, (const T *)q, c->n)                      \
         : mode == DIFF ? NAME##_diff((const T *)p, (const T *)q, c->n)                \
         : mode == CHAIN ? NAME##_chain((const T *)p, (T *)q, c->n, moved)             \
                        : NAME##_norm((const T *)p, c->n);
    switch (it->kind) {
    case F32: DISPATCH(f32, float)
    case F64: DISPATCH(f64, double)
    case F16: DISPATCH(f16, uint16_t)
    default: DISPATCH(bf16, uint16_t)
    }
#undef DISPATCH
}

static void *run_job(void *arg) {
    Job *job = (Job *)arg;
    for (int64_t k = job->first; k < job->last; k++)
        job->sums[2 * k] = run_chunk(&job->chunks[k], job->mode, &job->sums[2 * k + 1]);
    return NULL;
}

/* The passes over n items into out[n] (float64 sums; CHAIN: out[2n], the squares moved after the
 * sums of the differences), on up to `threads` threads. Returns 0, or -1 out of memory. */
static int run_passes(const Item *items, const int64_t *lengths, Py_ssize_t n, int mode, double *out, int threads) {
    int64_t n_chunks = 0, total = 0;
    for (Py_ssize_t i = 0; i < n; i++) n_chunks += (lengths[i] + CHUNK - 1) / CHUNK, total += lengths[i];
    Chunk *chunks = (Chunk *)calloc((size_t)(n_chunks > 0 ? n_chunks : 1), sizeof(Chunk));
    double *sums = (double *)calloc(2 * (size_t)(n_chunks > 0 ? n_chunks : 1), sizeof(double));
    if (chunks == NULL || sums == NULL) {
        free(chunks), free(sums);
        return -1;
    }
    int64_t k = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        for (int64_t start = 0; start < lengths[i]; start += CHUNK, k++) {
            Chunk c = {&items[i], start, lengths[i] - start < CHUNK ? lengths[i] - start : CHUNK};
            chunks[k] = c;
        }
    int jobs = threads < 1 ? 1 : (threads > MAX_THREADS ? MAX_THREADS : threads);
    if (total / MIN_PER_THREAD < jobs) jobs = total / MIN_PER_THREAD < 1 ? 1 : (int)(total / MIN_PER_THREAD);
#ifdef _WIN32
    jobs = 1;
#endif
    Job job[MAX_THREADS];
    int64_t seen = 0, cut = 0; /* job j ends where the running total passes (j + 1) / jobs of it */
    for (int j = 0; j < jobs; j++) {
        int64_t first = cut, goal = total / jobs * (j + 1);
        while (cut < n_chunks && (j == jobs - 1 || seen < goal)) seen += chunks[cut++].n;
        Job init = {chunks, sums, first, cut, mode};
        job[j] = init;
    }
#ifndef _WIN32
    pthread_t thread[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int j = 1; j < jobs; j++) started[j] = pthread_create(&thread[j], NULL, run_job, &job[j]) == 0;
    run_job(&job[0]);
    for (int j = 1; j < jobs; j++) {
        if (started[j]) pthread_join(thread[j], NULL);
        else run_job(&job[j]); /* no thread for it: do it here */
    }
#else
    run_job(&job[0]);
#endif
    k = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        double s = 0, t = 0;
        for (int64_t start = 0; start < lengths[i]; start += CHUNK, k++) s += sums[2 * k], t += sums[2 * k + 1];
        out[i] = s;
        if (mode == CHAIN) out[n + i] = t;
    }
    free(chunks), free(sums);
    return 0;
}

/* The kind of a buffer's items (see the top), or -1. */
static int kind_of(const Py_buffer *view) {
    const char *f = view->format != NULL ? view->format : "B";
    if (f[0] == '@' || f[0] == '=') f++;
    if (f[0] == '\0' || f[1] != '\0') return -1;
    if (f[0] == 'f' && view->itemsize == 4) return F32;
    if (f[0] == 'd' && view->itemsize == 8) return F64;
    if (f[0] == 'e' && view->itemsize == 2) return F16;
    if ((f[0] == 'h' || f[0] == 'H') && view->itemsize == 2) return BF16;
    return -1;
}

static int get_buffer(PyObject *obj, Py_buffer *view, int writable, const char *what, Py_ssize_t i) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        PyErr_Format(PyExc_TypeError, "`%s[%zd]` must be a C-contiguous%s buffer (a numpy array), got %.100s",
                     what, i, writable ? ", writable" : "", Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (kind_of(view) < 0) {
        PyErr_Format(PyExc_TypeError, "`%s[%zd]` must hold float32 ('f'), float64 ('d'), float16 ('e') or"
                     " bfloat16 (an int16 view, 'h') items, got format '%s'", what, i,
                     view->format != NULL ? view->format : "B");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Read the pairs' buffers (the second of a pair only where `seconds` is not None) into items and
 * views, checking kinds and lengths; returns how many views are held, -1 after an error (views released). */
static Py_ssize_t read_items(PyObject *firsts, PyObject *seconds, int mode, Py_ssize_t n, Item *items,
                             int64_t *lengths, Py_buffer *views) {
    static const char *names[4][2] = {{"copies", "params"}, {"after", "before"}, {"tensors", ""},
                                      {"after", "before"}};
    Py_ssize_t held = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_buffer *a = &views[held];
        if (get_buffer(PySequence_Fast_GET_ITEM(firsts, i), a, mode == COPY, names[mode][0], i) < 0) goto fail;
        held++;
        Item it = {(char *)a->buf, NULL, kind_of(a), (int)a->itemsize};
        if (mode != NORM) {
            Py_buffer *b = &views[held];
            if (get_buffer(PySequence_Fast_GET_ITEM(seconds, i), b, mode == CHAIN, names[mode][1], i) < 0) goto fail;
            held++;
            if (kind_of(b) != it.kind || b->len != a->len) {
                PyErr_Format(PyExc_ValueError, "`%s[%zd]` and `%s[%zd]` must hold as many items of one type; got"
                             " %zd bytes of '%s' and %zd bytes of '%s'", names[mode][0], i, names[mode][1], i,
                             a->len, a->format, b->len, b->format);
                goto fail;
            }
            it.second = (char *)b->buf;
        }
        items[i] = it;
        lengths[i] = (int64_t)(a->len / a->itemsize);
    }
    return held;
fail:
    for (Py_ssize_t j = 0; j < held; j++) PyBuffer_Release(&views[j]);
    return -1;
}

static PyObject *passes(int mode, PyObject *args) {
    PyObject *first_obj, *second_obj = NULL, *out_obj;
    int threads;
    int ok = mode == NORM ? PyArg_ParseTuple(args, "OOi", &first_obj, &out_obj, &threads)
                          : PyArg_ParseTuple(args, "OOOi", &first_obj, &second_obj, &out_obj, &threads);
    if (!ok) return NULL;
    PyObject *firsts = PySequence_Fast(first_obj, "the tensors must be a sequence");
    PyObject *seconds = second_obj == NULL ? NULL : PySequence_Fast(second_obj, "the tensors must be a sequence");
    if (firsts == NULL || (second_obj != NULL && seconds == NULL)) {
        Py_XDECREF(firsts), Py_XDECREF(seconds);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(firsts), held = -1;
    Py_buffer out;
    int status = -2;
    Item *items = (Item *)calloc((size_t)n + 1, sizeof(Item));
    int64_t *lengths = (int64_t *)calloc((size_t)n + 1, sizeof(int64_t));
    Py_buffer *views = (Py_buffer *)calloc(2 * (size_t)n + 1, sizeof(Py_buffer));
    if (items == NULL || lengths == NULL || views == NULL) {
        PyErr_NoMemory();
    } else if (seconds != NULL && PySequence_Fast_GET_SIZE(seconds) != n) {
        PyErr_Format(PyExc_ValueError, "expected as many tensors in both lists, got %zd and %zd", n,
                     PySequence_Fast_GET_SIZE(seconds));
    } else if (PyObject_GetBuffer(out_obj, &out, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) == 0) {
        Py_ssize_t wanted = mode == CHAIN ? 2 * n : n;
        if (kind_of(&out) != F64 || out.len != wanted * 8) {
            PyErr_Format(PyExc_ValueError, "`out` must hold %zd float64 items, got %zd bytes of '%s'", wanted, out.len,
                         out.format != NULL ? out.format : "B");
        } else if ((held = read_items(firsts, seconds, mode, n, items, lengths, views)) >= 0) {
            Py_BEGIN_ALLOW_THREADS
            status = run_passes(items, lengths, n, mode, (double *)out.buf, threads);
            Py_END_ALLOW_THREADS
        }
        PyBuffer_Release(&out);
    }
    for (Py_ssize_t j = 0; j < held; j++) PyBuffer_Release(&views[j]);
    free(items), free(lengths), free(views);
    Py_DECREF(firsts), Py_XDECREF(seconds);
    if (status == -1) return PyErr_NoMemory();
    if (status != 0) return NULL;
    Py_RETURN_NONE;
}

/* Names looked up on each tensor by tensor_squares, made once at import. */
static PyObject *s_dtype, *s_is_cpu, *s_is_contiguous, *s_numel, *s_data_ptr;

/* The kind of `t`'s items when it is a plain contiguous CPU tensor (exactly `tensor_type`) of one of
 * `dtypes` (float32, float16, bfloat16: see tensor_squares), with its address and length; -1 where it is not
 * (and no error set: a tensor refused goes to the tensor ops). */
static int tensor_item(PyObject *t, PyTypeObject *tensor_type, PyObject *const dtypes[3], Item *item,
                       int64_t *length) {
    static const int kinds[3] = {F32, F16, BF16}, sizes[3] = {4, 2, 2};
    if (Py_TYPE(t) != tensor_type) return -1;
    int kind = -1, size = 0;
    PyObject *value = PyObject_GetAttr(t, s_dtype);
    for (int k = 0; value != NULL && k < 3; k++)
        if (value == dtypes[k]) kind = kinds[k], size = sizes[k];
    Py_XDECREF(value);
    if (kind < 0) goto refuse;
    value = PyObject_GetAttr(t, s_is_cpu);
    int cpu = value == Py_True;
    Py_XDECREF(value);
    if (!cpu) goto refuse;
    value = PyObject_CallMethodObjArgs(t, s_is_contiguous, NULL);
    int contiguous = value == Py_True;
    Py_XDECREF(value);
    if (!contiguous) goto refuse;
    value = PyObject_CallMethodObjArgs(t, s_numel, NULL);
    long long n = value != NULL ? PyLong_AsLongLong(value) : -1;
    Py_XDECREF(value);
    if (n < 0) goto refuse;
    char *address = NULL;
    if (n > 0) { /* a tensor without storage (a transform's wrapper) raises here */
        value = PyObject_CallMethodObjArgs(t, s_data_ptr, NULL);
        address = value != NULL ? (char *)PyLong_AsVoidPtr(value) : NULL;
        Py_XDECREF(value);
        if (address == NULL) goto refuse;
    }
    Item it = {address, NULL, kind, size};
    *item = it;
    *length = (int64_t)n;
    return kind;
refuse:
    PyErr_Clear();
    return -1;
}

/* tensor_squares(tensors, out, threads, tensor_type, dtypes): NORM over the tensors themselves, not their
 * numpy views (a view costs about 0.8 us a tensor, these checks about a quarter of it). Every tensor must be
 * exactly `tensor_type` (torch.Tensor: no subclass, no parameter), on the CPU, contiguous, and of one of the
 * three `dtypes` (float32, float16, bfloat16; float64 is left to the tensor ops: its squares can overflow).
 * Returns True with out[i] = sum(tensors[i] ** 2) in float64, or False, out untouched, where any tensor is
 * not such a tensor. */
static PyObject *py_tensor_squares(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *tensors_obj, *out_obj, *type_obj, *dtypes_obj;
    int threads;
    if (!PyArg_ParseTuple(args, "OOiO!O!", &tensors_obj, &out_obj, &threads, &PyType_Type, &type_obj, &PyTuple_Type,
                          &dtypes_obj))
        return NULL;
    if (PyTuple_GET_SIZE(dtypes_obj) != 3) {
        PyErr_SetString(PyExc_ValueError, "`dtypes` must be (float32, float16, bfloat16)");
        return NULL;
    }
    PyObject *const dtypes[3] = {PyTuple_GET_ITEM(dtypes_obj, 0), PyTuple_GET_ITEM(dtypes_obj, 1),
                                 PyTuple_GET_ITEM(dtypes_obj, 2)};
    /* A tuple of its own (each tensor referenced): no other thread can free one while the GIL is released. */
    PyObject *tensors = PySequence_Tuple(tensors_obj);
    if (tensors == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(tensors);
    Item *items = (Item *)calloc((size_t)n + 1, sizeof(Item));
    int64_t *lengths = (int64_t *)calloc((size_t)n + 1, sizeof(int64_t));
    PyObject *result = NULL;
    Py_buffer out;
    int status = -2;
    if (items == NULL || lengths == NULL) {
        PyErr_NoMemory();
    } else if (PyObject_GetBuffer(out_obj, &out, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) == 0) {
        Py_ssize_t i = 0;
        if (kind_of(&out) != F64 || out.len != n * 8) {
            PyErr_Format(PyExc_ValueError, "`out` must hold %zd float64 items, got %zd bytes of '%s'", n, out.len,
                         out.format != NULL ? out.format : "B");
        } else {
            PyTypeObject *tensor_type = (PyTypeObject *)type_obj;
            while (i < n && tensor_item(PyTuple_GET_ITEM(tensors, i), tensor_type, dtypes, &items[i], &lengths[i]) >= 0)
                i++;
            if (i < n) {
                result = Py_False;
                Py_INCREF(result);
            } else {
                Py_BEGIN_ALLOW_THREADS
                status = run_passes(items, lengths, n, NORM, (double *)out.buf, threads);
                Py_END_ALLOW_THREADS
                if (status == 0) {
                    result = Py_True;
                    Py_INCREF(result);
                } else {
                    PyErr_NoMemory();
                }
            }
        }
        PyBuffer_Release(&out);
    }
    free(items), free(lengths);
    Py_DECREF(tensors);
    return result;
}

static PyObject *py_copy_squares(PyObject *self, PyObject *args) { (void)self; return passes(COPY, args); }
static PyObject *py_diff_squares(PyObject *self, PyObject *args) { (void)self; return passes(DIFF, args); }
static PyObject *py_squares(PyObject *self, PyObject *args) { (void)self; return passes(NORM, args); }
static PyObject *py_chain_squares(PyObject *self, PyObject *args) { (void)self; return passes(CHAIN, args); }

static PyMethodDef methods[] = {
    {"copy_squares", py_copy_squares, METH_VARARGS,
     "copy_squares(copies, params, out, threads): copy each of `params` into `copies` (writable buffers of the"
     " same type and length) and write the sum of each one's squares into the float64 buffer `out`."},
    {"diff_squares", py_diff_squares, METH_VARARGS,
     "diff_squares(after, before, out, threads): out[i] = sum((after[i] - before[i]) ** 2), in float64."},
    {"squares", py_squares, METH_VARARGS, "squares(tensors, out, threads): out[i] = sum(tensors[i] ** 2), in float64."},
    {"tensor_squares", py_tensor_squares, METH_VARARGS,
     "tensor_squares(tensors, out, threads, tensor_type, dtypes): out[i] = sum(tensors[i] ** 2), in float64, read from"
     " plain contiguous CPU tensors of `dtypes` (float32, float16, bfloat16) themselves; True, or False where one is"
     " not such a tensor (out untouched)."},
    {"chain_squares", py_chain_squares, METH_VARARGS,
     "chain_squares(after, before, out, threads): out[i] = sum((after[i] - before[i]) ** 2), then before[i] ="
     " after[i] (`before` writable) and out[n + i] = sum(after[i] ** 2), in float64; `out` holds 2n items."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cupdate", NULL, -1, methods, NULL, NULL, NULL, NULL};

/* Raised with every change of the functions' arguments: _update_passes.py ignores a stale build. */
#define ABI_VERSION 3

PyMODINIT_FUNC PyInit__cupdate(void) {
    if ((s_dtype = PyUnicode_InternFromString("dtype")) == NULL ||
        (s_is_cpu = PyUnicode_InternFromString("is_cpu")) == NULL ||
        (s_is_contiguous = PyUnicode_InternFromString("is_contiguous")) == NULL ||
        (s_numel = PyUnicode_InternFromString("numel")) == NULL ||
        (s_data_ptr = PyUnicode_InternFromString("data_ptr")) == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "ABI_VERSION", ABI_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
