/* Compiled evaluation of an expression tape (engine.expr.ExprBatch; optional).
 *
 * Why C: planning a new dispatch key evaluates every size expression of the graph, a few hundred
 * steps for a 1,000-instruction graph, and the Python tape costs ~0.3 us a step against a 1 ms
 * budget for the whole key (issue 3). Here a step is a few nanoseconds.
 *
 * The tape is three int64 arrays (opcode, left slot, right slot) over an int64 value array whose
 * first slots hold the symbol values, then the constants; step k writes slot ``first + k``, and the
 * results are picked from the slots. Arithmetic is exactly Python's on integers that stay within int64: floor division
 * and modulo, ceil_div as -((-a) // b). A symbol value that is not an int in int64, or a step that
 * would leave int64 or divide by zero, stops the run and returns False: the caller then evaluates
 * in Python, which reads numpy integers or raises the precise ExprError.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum { ADD, SUB, MUL, FLOORDIV, MOD, CEIL_DIV, MIN, MAX, N_OPS };

/* One step; 0 when the result is exact and in int64. */
static int step(int64_t op, int64_t a, int64_t b, int64_t *out)
{
    switch (op) {
    case ADD:
        return __builtin_add_overflow(a, b, out);
    case SUB:
        return __builtin_sub_overflow(a, b, out);
    case MUL:
        return __builtin_mul_overflow(a, b, out);
    case FLOORDIV:
    case MOD:
    case CEIL_DIV: {
        if (b == 0)
            return 1;
        if (b == -1) { /* a / -1 and a % -1 are undefined in C for INT64_MIN */
            if (op == MOD) {
                *out = 0;
                return 0;
            }
            return __builtin_sub_overflow((int64_t)0, a, out);
        }
        int64_t q = a / b, r = a % b; /* truncated */
        if (op == MOD) {
            *out = (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
        } else if (op == FLOORDIV) {
            *out = (r != 0 && ((r < 0) != (b < 0))) ? q - 1 : q;
        } else { /* ceiling: round the truncated quotient up when it was rounded down */
            *out = (r != 0 && ((r < 0) == (b < 0))) ? q + 1 : q;
        }
        return 0;
    }
    case MIN:
        *out = a < b ? a : b;
        return 0;
    case MAX:
        *out = a > b ? a : b;
        return 0;
    }
    return 1;
}

static int take(PyObject *obj, Py_buffer *view, int writable, const char *name)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    const char *f = view->format ? view->format : "";
    if (*f == '@' || *f == '=')
        f++;
    if (view->ndim != 1 || view->itemsize != 8 || !((f[0] == 'q' || f[0] == 'l') && f[1] == '\0')) {
        PyErr_Format(PyExc_ValueError, "%s must be a 1-D C-contiguous int64 array", name);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(evaluate_doc,
"evaluate(ops, left, right, start, values, picks, out) -> bool\n\n"
"One evaluation in one call: the slots begin as ``start`` with the first len(values) replaced by\n"
"``values`` (a list or tuple of Python ints), the tape runs, and out[k] = slot[picks[k]]. False\n"
"where a value is not an int in int64, or a step leaves int64 or divides by zero.");

static PyObject *evaluate(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *objs[5], *o_values, *o_out;
    if (!PyArg_ParseTuple(args, "OOOOOOO:evaluate", &objs[0], &objs[1], &objs[2], &objs[3], &o_values, &objs[4],
                          &o_out))
        return NULL;
    if (!PyList_Check(o_values) && !PyTuple_Check(o_values)) {
        PyErr_SetString(PyExc_TypeError, "values must be a list or a tuple");
        return NULL;
    }
    Py_buffer v[6];
    static const char *names[6] = {"ops", "left", "right", "start", "picks", "out"};
    PyObject *obj_of[6] = {objs[0], objs[1], objs[2], objs[3], objs[4], o_out};
    int held = 0;
    PyObject *result = NULL;
    int64_t *slots = NULL;
    for (; held < 6; held++)
        if (take(obj_of[held], &v[held], held == 5, names[held]) < 0)
            goto done;
    const int64_t *ops = v[0].buf, *left = v[1].buf, *right = v[2].buf, *start = v[3].buf, *picks = v[4].buf;
    int64_t *out = v[5].buf;
    Py_ssize_t steps = v[0].len / 8, first = v[3].len / 8, n_picks = v[4].len / 8;
    Py_ssize_t n_values = PySequence_Fast_GET_SIZE(o_values), slots_n = first + steps;
    if (v[1].len != v[0].len || v[2].len != v[0].len || n_values > first || v[5].len != v[4].len) {
        PyErr_SetString(PyExc_ValueError, "tape arrays, start, values or out of inconsistent lengths");
        goto done;
    }
    for (Py_ssize_t k = 0; k < steps; k++) {
        if (ops[k] < 0 || ops[k] >= N_OPS || left[k] < 0 || left[k] >= first + k || right[k] < 0 ||
            right[k] >= first + k) {
            PyErr_Format(PyExc_ValueError, "tape step %zd is malformed", k);
            goto done;
        }
    }
    for (Py_ssize_t k = 0; k < n_picks; k++) {
        if (picks[k] < 0 || picks[k] >= slots_n) {
            PyErr_Format(PyExc_ValueError, "picks[%zd] is not a slot", k);
            goto done;
        }
    }
    slots = PyMem_RawMalloc((size_t)(slots_n + 1) * sizeof(int64_t));
    if (slots == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(slots, start, (size_t)first * sizeof(int64_t));
    int ok = 1;
    PyObject **items = PySequence_Fast_ITEMS(o_values);
    for (Py_ssize_t k = 0; k < n_values && ok; k++) {
        int overflow = 0;
        long long x = PyLong_CheckExact(items[k]) ? PyLong_AsLongLongAndOverflow(items[k], &overflow) : 0;
        ok = PyLong_CheckExact(items[k]) && !overflow && !(x == -1 && PyErr_Occurred());
        slots[k] = x;
    }
    for (Py_ssize_t k = 0; k < steps && ok; k++)
        ok = !step(ops[k], slots[left[k]], slots[right[k]], &slots[first + k]);
    if (ok)
        for (Py_ssize_t k = 0; k < n_picks; k++)
            out[k] = slots[picks[k]];
    result = PyBool_FromLong(ok);
done:
    PyMem_RawFree(slots);
    while (held > 0)
        PyBuffer_Release(&v[--held]);
    return result;
}

static PyMethodDef methods[] = {
    {"evaluate", evaluate, METH_VARARGS, evaluate_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "engine._exprtape",
    "Compiled evaluation of engine.expr.ExprBatch tapes (optional; same values, same errors).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__exprtape(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "ADD", ADD) < 0 || PyModule_AddIntConstant(m, "SUB", SUB) < 0 ||
        PyModule_AddIntConstant(m, "MUL", MUL) < 0 || PyModule_AddIntConstant(m, "FLOORDIV", FLOORDIV) < 0 ||
        PyModule_AddIntConstant(m, "MOD", MOD) < 0 || PyModule_AddIntConstant(m, "CEIL_DIV", CEIL_DIV) < 0 ||
        PyModule_AddIntConstant(m, "MIN", MIN) < 0 || PyModule_AddIntConstant(m, "MAX", MAX) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
