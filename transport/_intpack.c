/* pack_int64(values, out) -> int: a list or tuple of ints written into a writable buffer of len(values) int64s.
 *
 * Why in C: a batch's addresses and lengths arrive as Python lists (sglang and every Mooncake-API caller pass
 * lists). The fastest conversion Python offers (struct.pack_into) costs about 37 ns per entry, a 4096-piece batch's
 * three lists about 0.45 ms on a 2-core machine: ten times what the whole batch costs on one GPU given as arrays.
 * Here one entry costs a type test and a read of the int's digits, about 2 ns (benchmarks/NOTES.md).
 *
 * Only exact ints are taken. The first entry that is not one (bool, a numpy integer, float, str, an int subclass)
 * or that does not fit int64 stops the pass, and its index is returned: the caller then takes its general path,
 * which accepts what it accepts (numpy integers) and names what it refuses. -1: every entry was written. Nothing
 * in the loop can run Python code, so the list cannot change under it. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* An int of at most two 30-bit digits (|v| < 2**60: every address and length a batch holds) is read from its
 * digits where CPython's layout of an int is known (3.11 to 3.13, the versions this was tested on); anything else
 * through PyLong_AsLongLongAndOverflow. Why: that call costs about 4 ns per 47-bit address on the 2-core machine,
 * the digits' read under 2, and a 4096-piece batch converts 12288 entries. */
#if PyLong_SHIFT == 30 && PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030E0000
#define PXN_INT_DIGITS 1
#else
#define PXN_INT_DIGITS 0
#endif

/* 0 and *out set, or -1: v (an exact int) does not fit int64. */
static inline int
read_int64(PyObject *v, int64_t *out)
{
#if PXN_INT_DIGITS
#if PY_VERSION_HEX >= 0x030C0000
    const uintptr_t tag = ((PyLongObject *)v)->long_value.lv_tag;
    const uintptr_t ndigits = tag >> 3; /* _PyLong_NON_SIZE_BITS */
    const digit *d = ((PyLongObject *)v)->long_value.ob_digit;
    const int negative = (tag & 3) == 2; /* _PyLong_SIGN_MASK; 1 is zero, which has no digit to read */
#else
    const Py_ssize_t size = Py_SIZE(v);
    const Py_ssize_t ndigits = size < 0 ? -size : size;
    const digit *d = ((PyLongObject *)v)->ob_digit;
    const int negative = size < 0;
#endif
    if (ndigits <= 2) {
        int64_t mag = ndigits == 0 ? 0 : ndigits == 1 ? (int64_t)d[0] : ((int64_t)d[1] << PyLong_SHIFT) | d[0];
        *out = negative ? -mag : mag;
        return 0;
    }
#endif
    int overflow;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow)
        return -1;
    *out = (int64_t)x;
    return 0;
}

static PyObject *
pack_int64(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "pack_int64 takes 2 arguments (values, out), got %zd", nargs);
        return NULL;
    }
    PyObject *values = args[0], *out = args[1];
    if (!PyList_CheckExact(values) && !PyTuple_CheckExact(values)) {
        PyErr_Format(PyExc_TypeError, "pack_int64: values must be a list or tuple, got %.100s",
                     Py_TYPE(values)->tp_name);
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(out, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(values);
    if (view.len != n * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_Format(PyExc_ValueError, "pack_int64: out holds %zd bytes, %zd entries need %zd",
                     view.len, n, n * (Py_ssize_t)sizeof(int64_t));
        PyBuffer_Release(&view);
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(values);
    int64_t *dst = (int64_t *)view.buf;
    Py_ssize_t bad = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = items[i];
        if (!PyLong_CheckExact(v) || read_int64(v, &dst[i]) < 0) {
            bad = i;
            break;
        }
    }
    PyBuffer_Release(&view);
    return PyLong_FromSsize_t(bad);
}

/* extremes_and_total(srcs, dsts, lengths) -> (min srcs, max srcs, min dsts, max dsts, min lengths, max lengths,
 * sum of lengths): a batch's three int64 columns of one length n >= 1, read once. Why: numpy reduces int64 at
 * about 1 ns per entry per reduction here (x86-64's baseline has no SIMD min for int64), and a batch's checks need
 * six reductions and a sum; for a few entries each numpy call's fixed cost dominates instead. The sum wraps
 * modulo 2**64 as numpy's does (the checks that follow bound every length). */
static int
int64_view(PyObject *obj, Py_buffer *view, const char *name)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    const char *f = view->format ? view->format : "";
    if (f[0] == '<' || f[0] == '=' || f[0] == '@')
        f++;
    if (view->itemsize != 8 || (strcmp(f, "l") != 0 && strcmp(f, "q") != 0)) {
        PyErr_Format(PyExc_TypeError, "extremes_and_total: %s must hold native int64 entries, got format '%s'",
                     name, view->format ? view->format : "");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static void
extremes(const int64_t *x, Py_ssize_t n, int64_t *lo, int64_t *hi)
{
    /* two independent chains: the loop runs at the compare-and-move throughput, not its latency */
    int64_t mn0 = x[0], mx0 = x[0], mn1 = x[0], mx1 = x[0];
    Py_ssize_t i = 1;
    for (; i + 1 < n; i += 2) {
        int64_t u = x[i], v = x[i + 1];
        mn0 = u < mn0 ? u : mn0;
        mx0 = u > mx0 ? u : mx0;
        mn1 = v < mn1 ? v : mn1;
        mx1 = v > mx1 ? v : mx1;
    }
    if (i < n) {
        mn0 = x[i] < mn0 ? x[i] : mn0;
        mx0 = x[i] > mx0 ? x[i] : mx0;
    }
    *lo = mn0 < mn1 ? mn0 : mn1;
    *hi = mx0 > mx1 ? mx0 : mx1;
}

static PyObject *
extremes_and_total(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *names[3] = {"srcs", "dsts", "lengths"};
    Py_buffer views[3];
    int64_t lo[3], hi[3];
    uint64_t total = 0;
    Py_ssize_t n = -1;
    int k, held = 0;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "extremes_and_total takes 3 arguments (srcs, dsts, lengths), got %zd", nargs);
        return NULL;
    }
    for (k = 0; k < 3; k++) {
        if (int64_view(args[k], &views[k], names[k]) < 0)
            goto fail;
        held++;
        Py_ssize_t len = views[k].len / 8;
        if (n < 0)
            n = len;
        if (len != n || n == 0) {
            PyErr_Format(PyExc_ValueError, "extremes_and_total: %s holds %zd entries, srcs %zd (need one length >= 1)",
                         names[k], len, n);
            goto fail;
        }
    }
    for (k = 0; k < 3; k++)
        extremes((const int64_t *)views[k].buf, n, &lo[k], &hi[k]);
    {
        const int64_t *x = (const int64_t *)views[2].buf;
        uint64_t t0 = 0, t1 = 0;
        Py_ssize_t i = 0;
        for (; i + 1 < n; i += 2) {
            t0 += (uint64_t)x[i];
            t1 += (uint64_t)x[i + 1];
        }
        if (i < n)
            t0 += (uint64_t)x[i];
        total = t0 + t1;
    }
    for (k = 0; k < 3; k++)
        PyBuffer_Release(&views[k]);
    return Py_BuildValue("(LLLLLLL)", (long long)lo[0], (long long)hi[0], (long long)lo[1], (long long)hi[1],
                         (long long)lo[2], (long long)hi[2], (long long)(int64_t)total);
fail:
    for (k = 0; k < held; k++)
        PyBuffer_Release(&views[k]);
    return NULL;
}

static PyMethodDef methods[] = {
    {"pack_int64", (PyCFunction)(void (*)(void))pack_int64, METH_FASTCALL,
     "pack_int64(values, out) -> int: write a list or tuple of exact ints into out (len(values) int64s); -1 when\n"
     "all were written, else the index of the first entry that is not an exact int or does not fit int64."},
    {"extremes_and_total", (PyCFunction)(void (*)(void))extremes_and_total, METH_FASTCALL,
     "extremes_and_total(srcs, dsts, lengths) -> (min, max of srcs, of dsts, of lengths, sum of lengths): three\n"
     "int64 buffers of one length >= 1, read once; the sum wraps modulo 2**64 as numpy's does."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_intpack", NULL, -1, methods};

PyMODINIT_FUNC
PyInit__intpack(void)
{
    PyObject *m = PyModule_Create(&module);
    /* READS_DIGITS: 1 where ints are read from their digits (read_int64), for tests and benchmarks to report */
    if (m != NULL && PyModule_AddIntConstant(m, "READS_DIGITS", PXN_INT_DIGITS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
