/* The context builder's gather of scattered rows: dst[m, i, :] = src[m, rows[i], :].
 *
 * A decode step reads one row per slot and module at random from a store far larger than
 * the cache, so its time is memory latency. This loop asks for the row a few iterations
 * ahead while it copies the current one, and runs on the OpenMP runtime that torch has
 * already loaded (the same libgomp.so.1 soname), so its threads are torch's own and do not
 * compete with them. fxreplace/gather.py calls it; without it, index_select does the work. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Rows requested ahead, into every cache level (prefetcht0). Side by side on bench_context's
 * decode rows (256-byte rows, the store in memory), 32 rows ahead into L1 gathered 1.4-1.8x
 * faster than 16 ahead as non-temporal prefetches (prefetchnta), which the cache may drop before
 * the copy reads them; 24 to 96 ahead were alike, for 128-byte to 4 KiB rows. */
#define AHEAD 32

static PyObject *gather_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "gather_rows(src, src_module_stride, src_rows, dst, dst_module_stride, "
                                         "row_bytes, modules, rows, slots, threads): 10 integers");
        return NULL;
    }
    long long v[10];
    for (int a = 0; a < 10; a++) {
        v[a] = PyLong_AsLongLong(args[a]);
        if (v[a] == -1 && PyErr_Occurred()) return NULL;
    }
    const char *src = (const char *)(intptr_t)v[0];
    const int64_t src_stride = v[1], src_rows = v[2];
    char *dst = (char *)(intptr_t)v[3];
    const int64_t dst_stride = v[4], row_bytes = v[5], modules = v[6];
    const int64_t *rows = (const int64_t *)(intptr_t)v[7];
    const int64_t slots = v[8];
    const int threads = (int)v[9];
    for (int64_t i = 0; i < slots; i++) /* a wrong row would read outside the store */
        if (rows[i] < 0 || rows[i] >= src_rows) {
            PyErr_Format(PyExc_IndexError, "gather_rows: slot %lld asks for row %lld of a source of %lld rows",
                         (long long)i, (long long)rows[i], (long long)src_rows);
            return NULL;
        }
    const int64_t total = modules * slots;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t k = 0; k < total; k++) {
        const int64_t m = k / slots, i = k - m * slots;
#ifdef __GNUC__
        const int64_t ahead = k + AHEAD;
        if (ahead < total) {
            const int64_t am = ahead / slots;
            const char *row = src + am * src_stride + rows[ahead - am * slots] * row_bytes;
            for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(row + o, 0, 3);
        }
#endif
        memcpy(dst + m * dst_stride + i * row_bytes, src + m * src_stride + rows[i] * row_bytes, (size_t)row_bytes);
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"gather_rows", (PyCFunction)(void (*)(void))gather_rows, METH_FASTCALL,
     "dst[m, i, :] = src[m, rows[i], :] over raw pointers and byte strides (see fxreplace/gather.py)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_gather", NULL, -1, methods};

PyMODINIT_FUNC PyInit__gather(void) { return PyModule_Create(&module); }
