/* CRC-32C (Castagnoli) of TensorBoard's event records, in C (lightning_hooks.output._crc32c).
 *
 * Every record TensorBoard writes carries a masked CRC-32C of its bytes; without TensorFlow,
 * TensorBoard computes it one Python loop iteration per byte, and _crc32c.py's numpy version
 * still costs about 3-4 ns a byte, holding the GIL on the writer's thread. Here: the SSE4.2
 * crc32 instruction where the CPU has it (checked at import), 8 bytes a step, otherwise
 * slicing-by-8 tables; the GIL is released over large buffers. The extension is optional:
 * without a C compiler _crc32c.py's numpy version gives the same checksums.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define POLY 0x82F63B78u /* the Castagnoli polynomial, bit-reversed */
#define RELEASE_GIL_FROM 65536 /* bytes; below this, releasing and taking the GIL again costs more */

static uint32_t table[8][256]; /* table[k][b]: byte b's register after k more zero bytes */

static void make_tables(void) {
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t crc = b;
        for (int bit = 0; bit < 8; bit++) crc = crc & 1 ? (crc >> 1) ^ POLY : crc >> 1;
        table[0][b] = crc;
    }
    for (uint32_t b = 0; b < 256; b++)
        for (int k = 1; k < 8; k++) table[k][b] = (table[k - 1][b] >> 8) ^ table[0][table[k - 1][b] & 0xFF];
}

/* Slicing-by-8: the register after `n` bytes at `p`, from register `crc` (no inversions here). */
static uint32_t crc_tables(uint32_t crc, const uint8_t *p, size_t n) {
    for (; n >= 8; p += 8, n -= 8) {
        uint32_t lo, hi;
        memcpy(&lo, p, 4), memcpy(&hi, p + 4, 4); /* little-endian words: x86-64, arm64 */
        lo ^= crc;
        crc = table[7][lo & 0xFF] ^ table[6][(lo >> 8) & 0xFF] ^ table[5][(lo >> 16) & 0xFF] ^ table[4][lo >> 24] ^
              table[3][hi & 0xFF] ^ table[2][(hi >> 8) & 0xFF] ^ table[1][(hi >> 16) & 0xFF] ^ table[0][hi >> 24];
    }
    for (; n > 0; p++, n--) crc = (crc >> 8) ^ table[0][(crc ^ *p) & 0xFF];
    return crc;
}

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_SSE42 1
/* The crc32 instruction of SSE4.2 computes exactly this register update, 8 bytes at a time. */
__attribute__((target("sse4.2"))) static uint32_t crc_sse42(uint32_t crc, const uint8_t *p, size_t n) {
    uint64_t c = crc;
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t word;
        memcpy(&word, p, 8);
        c = __builtin_ia32_crc32di(c, word);
    }
    uint32_t c32 = (uint32_t)c;
    for (; n > 0; p++, n--) c32 = __builtin_ia32_crc32qi(c32, *p);
    return c32;
}
#endif

static int use_sse42 = 0; /* set at import; a test can switch it to check both ways agree */

static uint32_t crc32c(const uint8_t *p, size_t n) {
#ifdef HAVE_SSE42
    if (use_sse42) return ~crc_sse42(0xFFFFFFFFu, p, n);
#endif
    return ~crc_tables(0xFFFFFFFFu, p, n);
}

static PyObject *py_crc32c(PyObject *self, PyObject *arg) {
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) {
        PyErr_Format(PyExc_TypeError, "crc32c: `data` must be a contiguous bytes-like object (bytes, bytearray,"
                     " memoryview), got %.100s", Py_TYPE(arg)->tp_name);
        return NULL;
    }
    uint32_t crc;
    if (view.len >= RELEASE_GIL_FROM) {
        Py_BEGIN_ALLOW_THREADS
        crc = crc32c((const uint8_t *)view.buf, (size_t)view.len);
        Py_END_ALLOW_THREADS
    } else {
        crc = crc32c((const uint8_t *)view.buf, (size_t)view.len);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(crc);
}

static PyObject *py_set_sse42(PyObject *self, PyObject *args) {
    (void)self;
    int on, before = use_sse42;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
#ifdef HAVE_SSE42
    use_sse42 = on && __builtin_cpu_supports("sse4.2");
#endif
    return PyBool_FromLong(before);
}

static PyMethodDef methods[] = {
    {"crc32c", py_crc32c, METH_O,
     "crc32c(data): the CRC-32C (Castagnoli) of a bytes-like object, as TensorBoard's crc32c gives it."},
    {"set_sse42", py_set_sse42, METH_VARARGS,
     "set_sse42(on): use the SSE4.2 crc32 instruction (where the CPU has it) or the tables; returns the"
     " previous setting."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_crc32c_native", NULL, -1, methods, NULL, NULL, NULL,
                                    NULL};

PyMODINIT_FUNC PyInit__crc32c_native(void) {
    make_tables();
#ifdef HAVE_SSE42
    __builtin_cpu_init();
    use_sse42 = __builtin_cpu_supports("sse4.2") != 0;
#endif
    return PyModule_Create(&module);
}
