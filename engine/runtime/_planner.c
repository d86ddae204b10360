/* Compiled passes of the memory planner (engine.runtime.memory and .plan; docs/memory.md).
 *
 * Why C: planning a new dispatch key of a 1,000-instruction graph has a budget of 1 ms (issue 3),
 * and a best-fit pass over ~1,600 blocks costs 1-6 ms in vectorised numpy (one round of ~20 numpy
 * calls per link of the longest chain of interfering blocks) against ~0.1 ms here; a key's sizes
 * here are one call where numpy needs a dozen, each of which costs tens of microseconds when the
 * CPU caches are cold (as they are when a new key arrives between runs). The Python modules keep
 * the same algorithms in numpy and pure Python, and use them when this extension was not built
 * (it is optional: an install without a C compiler still works, only slower). Results are exactly
 * those of the Python passes (tests/test_native_planner.py compares them).
 *
 * Every array is a 1-D C-contiguous int64 buffer. Interference (which blocks share a position in
 * time) arrives as CSR: the neighbours of block i are indices[indptr[i]:indptr[i + 1]]. Inputs are
 * checked (lengths, index ranges, permutations, size totals) before any pointer is followed, so a
 * wrong call raises ValueError instead of reading out of bounds. The GIL is released while a pass
 * runs: planning a key then does not stall other threads' runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LIMIT (((int64_t)1) << 62) /* sum of sizes: every offset + size stays far from overflow */

/* Raised for sizes these passes do not take (negative, or adding up past LIMIT): the caller plans
 * those with Python integers instead. Every other bad argument is a plain ValueError (a bug). */
static PyObject *SizeError;

typedef struct {
    int64_t lo, hi;
} span;

/* -- argument handling ------------------------------------------------------------------------ */

typedef struct {
    Py_buffer view;
    int held;
    int64_t *data;
    Py_ssize_t len;
} array;

static void release(array *a, int count)
{
    for (int i = 0; i < count; i++) {
        if (a[i].held) {
            PyBuffer_Release(&a[i].view);
            a[i].held = 0;
        }
    }
}

static int is_int64_format(const char *format)
{
    if (format == NULL)
        return 0;
    if (*format == '@' || *format == '=')
        format++;
#if PY_LITTLE_ENDIAN
    else if (*format == '<')
        format++;
#else
    else if (*format == '>' || *format == '!')
        format++;
#endif
    return (format[0] == 'q' || format[0] == 'l') && format[1] == '\0';
}

static int take(PyObject *obj, array *out, int writable, const char *name)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &out->view, flags) < 0)
        return -1;
    out->held = 1;
    if (out->view.ndim != 1 || out->view.itemsize != 8 || !is_int64_format(out->view.format)) {
        PyErr_Format(PyExc_ValueError, "%s must be a 1-D C-contiguous int64 array (format %s, %d dims)",
                     name, out->view.format ? out->view.format : "?", out->view.ndim);
        return -1;
    }
    out->data = (int64_t *)out->view.buf;
    out->len = out->view.len / 8;
    return 0;
}

/* Take ``count`` arrays (``a`` zeroed first, so that ``release`` is always safe); those from
 * ``first_writable`` on are outputs. */
static int take_all(PyObject *const *objs, array *a, int count, const char *const *names, int first_writable)
{
    memset(a, 0, sizeof(array) * (size_t)count);
    for (int k = 0; k < count; k++)
        if (take(objs[k], &a[k], k >= first_writable, names[k]) < 0)
            return -1;
    return 0;
}

/* n blocks: indptr has n + 1 entries from 0, not decreasing, ending at len(indices); every index
 * names another block. */
static int check_graph(const array *indptr, const array *indices, Py_ssize_t n)
{
    if (indptr->len != n + 1) {
        PyErr_Format(PyExc_ValueError, "indptr has %zd entries for %zd blocks; expected %zd", indptr->len, n, n + 1);
        return -1;
    }
    const int64_t *p = indptr->data;
    if (p[0] != 0 || p[n] != indices->len) {
        PyErr_Format(PyExc_ValueError, "indptr must run from 0 to len(indices) = %zd", indices->len);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (p[i + 1] < p[i]) {
            PyErr_Format(PyExc_ValueError, "indptr decreases at block %zd", i);
            return -1;
        }
    }
    for (Py_ssize_t k = 0; k < indices->len; k++) {
        int64_t j = indices->data[k];
        if (j < 0 || j >= n) {
            PyErr_Format(PyExc_ValueError, "indices[%zd] = %lld is not a block (0..%zd)", k, (long long)j, n - 1);
            return -1;
        }
    }
    return 0;
}

static int check_sizes(const array *sizes)
{
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < sizes->len; i++) {
        int64_t s = sizes->data[i];
        if (s < 0) {
            PyErr_Format(SizeError, "sizes[%zd] = %lld is negative", i, (long long)s);
            return -1;
        }
        if (s > LIMIT - total) {
            PyErr_SetString(SizeError, "sizes add up to more than 2**62 bytes");
            return -1;
        }
        total += s;
    }
    return 0;
}

/* order must list every block once; ``seen`` is n bytes of scratch. */
static int check_permutation(const array *order, Py_ssize_t n, unsigned char *seen)
{
    if (order->len != n) {
        PyErr_Format(PyExc_ValueError, "order has %zd entries for %zd blocks", order->len, n);
        return -1;
    }
    memset(seen, 0, (size_t)n);
    for (Py_ssize_t k = 0; k < n; k++) {
        int64_t i = order->data[k];
        if (i < 0 || i >= n || seen[i]) {
            PyErr_Format(PyExc_ValueError, "order is not a permutation of the blocks (entry %zd = %lld)", k,
                         (long long)i);
            return -1;
        }
        seen[i] = 1;
    }
    return 0;
}

/* -- best-fit --------------------------------------------------------------------------------- */

/* Spans are ordered by their low end only: among spans that start at the same offset only the first
 * can bound a gap (each has a positive size, so the next one starts below the running top), so their
 * order does not change the result. */
static int by_low(const void *a, const void *b)
{
    const span *x = a, *y = b;
    return (x->lo > y->lo) - (x->lo < y->lo);
}

static void sort_spans(span *s, Py_ssize_t m)
{
    if (m > 32) {
        qsort(s, (size_t)m, sizeof(span), by_low);
        return;
    }
    for (Py_ssize_t k = 1; k < m; k++) { /* short rows (most of them): insertion sort */
        span v = s[k];
        Py_ssize_t j = k;
        while (j > 0 && s[j - 1].lo > v.lo) {
            s[j] = s[j - 1];
            j--;
        }
        s[j] = v;
    }
}

typedef struct {
    Py_ssize_t n;
    const int64_t *indptr, *indices, *sizes;
    int64_t *top;
    span *busy;
} planner;

/* One pass in ``order``: each block goes into the gap among its placed neighbours that wastes the
 * fewest bytes (the lowest on a tie, the first exact fit at once), or on top of them all. Blocks
 * of size 0 get offset 0 and take no space. Returns the peak. */
static int64_t best_fit_pass(const planner *p, const int64_t *order, int64_t *offsets)
{
    const int64_t *indptr = p->indptr, *indices = p->indices, *sizes = p->sizes;
    span *busy = p->busy;
    int64_t *top = p->top; /* the top of each placed block, -1 while not placed */
    for (Py_ssize_t i = 0; i < p->n; i++) {
        top[i] = -1;
        offsets[i] = 0; /* read (and ignored) for neighbours not yet placed */
    }
    int64_t peak = 0;
    for (Py_ssize_t k = 0; k < p->n; k++) {
        int64_t i = order[k], size = sizes[i];
        if (size <= 0) {
            offsets[i] = 0;
            continue;
        }
        Py_ssize_t m = 0;
        for (int64_t e = indptr[i], end = indptr[i + 1]; e < end; e++) {
            int64_t j = indices[e]; /* written always, kept if placed: no branch to mispredict */
            busy[m].lo = offsets[j];
            busy[m].hi = top[j];
            m += top[j] >= 0;
        }
        sort_spans(busy, m);
        int64_t best = -1, best_waste = 0, cursor = 0;
        for (Py_ssize_t q = 0; q < m; q++) {
            int64_t gap = busy[q].lo - cursor;
            if (gap >= size && (best < 0 || gap - size < best_waste)) {
                best = cursor;
                best_waste = gap - size;
                if (best_waste == 0)
                    break;
            }
            if (busy[q].hi > cursor)
                cursor = busy[q].hi;
        }
        int64_t offset = best >= 0 ? best : cursor;
        offsets[i] = offset;
        top[i] = offset + size;
        if (offset + size > peak)
            peak = offset + size;
    }
    return peak;
}

/* ``rounds`` passes from ``order``: the first as given, each next one with the blocks that reached
 * the previous pass's peak moved to the front (kept in order). The lowest peak wins (the first on
 * a tie); stops at the first pass at or below ``target``. */
static int64_t squeaky_wheel(const planner *p, const int64_t *order_in, int64_t rounds, int64_t target,
                             int64_t *best, int64_t *order, int64_t *next, int64_t *offsets)
{
    Py_ssize_t n = p->n;
    memcpy(order, order_in, (size_t)n * sizeof(int64_t));
    int64_t best_peak = -1;
    for (int64_t r = 0; r < rounds; r++) {
        if (r > 0) {
            int64_t peak = 0; /* of the previous pass, which may not be the best */
            for (Py_ssize_t i = 0; i < n; i++)
                if (offsets[i] + p->sizes[i] > peak)
                    peak = offsets[i] + p->sizes[i];
            Py_ssize_t h = 0;
            for (Py_ssize_t k = 0; k < n; k++)
                if (offsets[order[k]] + p->sizes[order[k]] == peak)
                    next[h++] = order[k];
            for (Py_ssize_t k = 0; k < n; k++)
                if (offsets[order[k]] + p->sizes[order[k]] != peak)
                    next[h++] = order[k];
            int64_t *swap = order;
            order = next;
            next = swap;
        }
        int64_t peak = best_fit_pass(p, order, offsets);
        if (best_peak < 0 || peak < best_peak) {
            best_peak = peak;
            memcpy(best, offsets, (size_t)n * sizeof(int64_t));
            if (peak <= target)
                break;
        }
    }
    return best_peak;
}

PyDoc_STRVAR(plan_doc,
"plan(indptr, indices, sizes, order, offsets, rounds, target) -> peak\n\n"
"Best-fit in ``order``, then up to ``rounds - 1`` squeaky-wheel passes (blocks that reach the\n"
"peak go first), stopping at the first peak <= ``target``. The best offsets are written to\n"
"``offsets``; returns their peak. Equals the Python passes of engine.runtime.memory.");

static PyObject *plan(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[5];
    long long rounds, target;
    if (!PyArg_ParseTuple(args, "OOOOOLL:plan", &o[0], &o[1], &o[2], &o[3], &o[4], &rounds, &target))
        return NULL;
    static const char *const names[5] = {"indptr", "indices", "sizes", "order", "offsets"};
    array a[5];
    PyObject *result = NULL;
    void *work = NULL;
    if (take_all(o, a, 5, names, 4) < 0)
        goto done;
    Py_ssize_t n = a[2].len;
    if (a[4].len != n) {
        PyErr_Format(PyExc_ValueError, "offsets has %zd entries for %zd blocks", a[4].len, n);
        goto done;
    }
    if (rounds < 1) {
        PyErr_SetString(PyExc_ValueError, "rounds must be at least 1");
        goto done;
    }
    Py_ssize_t max_degree = 0;
    if (check_graph(&a[0], &a[1], n) < 0 || check_sizes(&a[2]) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++)
        if (a[0].data[i + 1] - a[0].data[i] > max_degree)
            max_degree = (Py_ssize_t)(a[0].data[i + 1] - a[0].data[i]);
    /* scratch: two orders, the current offsets, the tops, neighbour spans, and flags for the check */
    size_t ints = (size_t)n * 4 * sizeof(int64_t);
    size_t spans = (size_t)(max_degree + 1) * sizeof(span);
    work = PyMem_RawMalloc(ints + spans + (size_t)n + 1);
    if (work == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t *order = work, *next = order + n, *offsets = next + n, *top = offsets + n;
    span *busy = (span *)(top + n);
    unsigned char *seen = (unsigned char *)(busy + max_degree + 1);
    if (check_permutation(&a[3], n, seen) < 0)
        goto done;
    planner p = {n, a[0].data, a[1].data, a[2].data, top, busy};
    int64_t peak = 0;
    if (n > 0) {
        Py_BEGIN_ALLOW_THREADS
        peak = squeaky_wheel(&p, a[3].data, rounds, target, a[4].data, order, next, offsets);
        Py_END_ALLOW_THREADS
    }
    result = PyLong_FromLongLong(peak);
done:
    PyMem_RawFree(work);
    release(a, 5);
    return result;
}

/* -- replay ----------------------------------------------------------------------------------- */

PyDoc_STRVAR(replay_doc,
"replay(indptr, indices, sizes, template_offsets, order, offsets) -> peak\n\n"
"Stack the blocks as a finished plan (``template_offsets``) did, with other ``sizes``: each block\n"
"sits on the highest top among its neighbours that lay below it in the template. ``order`` lists\n"
"the blocks by template offset (not decreasing), so that every block comes after the blocks below\n"
"it. Writes ``offsets``; returns the peak.");

static PyObject *replay(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[6];
    if (!PyArg_ParseTuple(args, "OOOOOO:replay", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5]))
        return NULL;
    static const char *const names[6] = {"indptr", "indices", "sizes", "template_offsets", "order", "offsets"};
    array a[6];
    PyObject *result = NULL;
    void *work = NULL;
    if (take_all(o, a, 6, names, 5) < 0)
        goto done;
    Py_ssize_t n = a[2].len;
    if (a[3].len != n || a[5].len != n) {
        PyErr_Format(PyExc_ValueError, "template_offsets and offsets need %zd entries", n);
        goto done;
    }
    if (check_graph(&a[0], &a[1], n) < 0 || check_sizes(&a[2]) < 0)
        goto done;
    work = PyMem_RawCalloc((size_t)n * (sizeof(int64_t) + 1) + 1, 1);
    if (work == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t *tops = work; /* zero until set: read (and ignored) for blocks not below */
    if (check_permutation(&a[4], n, (unsigned char *)(tops + n)) < 0)
        goto done;
    const int64_t *indptr = a[0].data, *indices = a[1].data, *sizes = a[2].data, *template = a[3].data;
    const int64_t *order = a[4].data;
    for (Py_ssize_t k = 1; k < n; k++) {
        if (template[order[k]] < template[order[k - 1]]) {
            PyErr_Format(PyExc_ValueError, "order is not sorted by template offset at entry %zd", k);
            goto done;
        }
    }
    int64_t *offsets = a[5].data, peak = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < n; k++) {
        int64_t i = order[k], low = 0, here = template[i];
        for (int64_t e = indptr[i], end = indptr[i + 1]; e < end; e++) {
            int64_t j = indices[e];
            int64_t t = template[j] < here ? tops[j] : 0; /* j is below i: it came earlier, its top is set */
            low = t > low ? t : low;
        }
        offsets[i] = low;
        tops[i] = low + sizes[i];
        peak = tops[i] > peak ? tops[i] : peak;
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromLongLong(peak);
done:
    PyMem_RawFree(work);
    release(a, 6);
    return result;
}

/* -- lower bound ------------------------------------------------------------------------------ */

PyDoc_STRVAR(live_peak_doc,
"live_peak(starts, ends, sizes) -> int\n\n"
"The largest total of ``sizes`` over blocks live at one position (ranges inclusive): the lower\n"
"bound of any plan.");

static PyObject *live_peak(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[3];
    if (!PyArg_ParseTuple(args, "OOO:live_peak", &o[0], &o[1], &o[2]))
        return NULL;
    static const char *const names[3] = {"starts", "ends", "sizes"};
    array a[3];
    PyObject *result = NULL;
    int64_t *delta = NULL;
    if (take_all(o, a, 3, names, 3) < 0)
        goto done;
    Py_ssize_t n = a[2].len;
    if (a[0].len != n || a[1].len != n) {
        PyErr_Format(PyExc_ValueError, "starts, ends and sizes differ in length (%zd, %zd, %zd)", a[0].len,
                     a[1].len, n);
        goto done;
    }
    if (check_sizes(&a[2]) < 0)
        goto done;
    int64_t last = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (a[0].data[i] < 0 || a[1].data[i] < a[0].data[i]) {
            PyErr_Format(PyExc_ValueError, "block %zd has range %lld..%lld", i, (long long)a[0].data[i],
                         (long long)a[1].data[i]);
            goto done;
        }
        if (a[1].data[i] > last)
            last = a[1].data[i];
    }
    if (last >= ((int64_t)1) << 32) {
        PyErr_Format(PyExc_ValueError, "a block ends at position %lld", (long long)last);
        goto done;
    }
    delta = PyMem_RawCalloc((size_t)(last + 2), sizeof(int64_t));
    if (delta == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        delta[a[0].data[i]] += a[2].data[i];
        delta[a[1].data[i] + 1] -= a[2].data[i];
    }
    int64_t live = 0, peak = 0;
    for (int64_t t = 0; t <= last; t++) {
        live += delta[t];
        if (live > peak)
            peak = live;
    }
    result = PyLong_FromLongLong(peak);
done:
    PyMem_RawFree(delta);
    release(a, 3);
    return result;
}

/* -- a key's sizes ---------------------------------------------------------------------------- */

PyDoc_STRVAR(key_sizes_doc,
"key_sizes(values, dims, rank, items, workspaces, out) -> bool\n\n"
"A key's byte counts from its expression values: for each distinct tensor size r, items[r] times\n"
"the product of values[dims[r * rank + k]] over k; then for each kernel, values[workspaces[j]].\n"
"Written to ``out``. False (``out`` partly written) where a dimension is negative, a size passes\n"
"2**62 bytes on the way, or a workspace is negative or over 2**62: the caller finds which, and\n"
"says so.");

static PyObject *key_sizes(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[5];
    Py_ssize_t rank;
    if (!PyArg_ParseTuple(args, "OOnOOO:key_sizes", &o[0], &o[1], &rank, &o[2], &o[3], &o[4]))
        return NULL;
    static const char *const names[5] = {"values", "dims", "items", "workspaces", "out"};
    array a[5];
    PyObject *result = NULL;
    if (take_all(o, a, 5, names, 4) < 0)
        goto done;
    Py_ssize_t n_sizes = a[2].len, n_ws = a[3].len, n_values = a[0].len;
    if (rank < 0 || a[1].len != n_sizes * rank || a[4].len != n_sizes + n_ws) {
        PyErr_SetString(PyExc_ValueError, "dims must hold rank entries per size, out one per size and workspace");
        goto done;
    }
    for (Py_ssize_t k = 0; k < a[1].len; k++) {
        if (a[1].data[k] < 0 || a[1].data[k] >= n_values) {
            PyErr_Format(PyExc_ValueError, "dims[%zd] is not an index into values", k);
            goto done;
        }
    }
    for (Py_ssize_t k = 0; k < n_ws; k++) {
        if (a[3].data[k] < 0 || a[3].data[k] >= n_values) {
            PyErr_Format(PyExc_ValueError, "workspaces[%zd] is not an index into values", k);
            goto done;
        }
    }
    const int64_t *values = a[0].data, *dims = a[1].data, *items = a[2].data, *ws = a[3].data;
    int64_t *out = a[4].data;
    int ok = 1;
    for (Py_ssize_t r = 0; r < n_sizes && ok; r++) {
        int64_t bytes = items[r];
        ok = bytes >= 0 && bytes <= LIMIT;
        for (Py_ssize_t k = 0; k < rank && ok; k++) {
            int64_t d = values[dims[r * rank + k]];
            ok = d >= 0 && !__builtin_mul_overflow(bytes, d, &bytes) && bytes <= LIMIT;
        }
        out[r] = bytes;
    }
    for (Py_ssize_t j = 0; j < n_ws && ok; j++) {
        int64_t w = values[ws[j]];
        ok = w >= 0 && w <= LIMIT;
        out[n_sizes + j] = w;
    }
    result = PyBool_FromLong(ok);
done:
    release(a, 5);
    return result;
}

/* -- one kind's blocks at a key --------------------------------------------------------------- */

PyDoc_STRVAR(kind_sizes_doc,
"kind_sizes(size_vector, size_src, alignment, starts, ends, raw, aligned, pad) -> (total, bound)\n\n"
"The blocks of one kind at a key: raw[i] = size_vector[size_src[i]], aligned[i] = raw[i] rounded\n"
"up to ``alignment`` (with ``pad``, empty blocks take the smallest aligned size, or 1), their total\n"
"and their lower bound (the most bytes live at one position). SizeError where a size is negative\n"
"or the total passes 2**62.");

static PyObject *kind_sizes(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[7];
    long long alignment;
    int pad;
    if (!PyArg_ParseTuple(args, "OOLOOOOp:kind_sizes", &o[0], &o[1], &alignment, &o[2], &o[3], &o[4], &o[5], &pad))
        return NULL;
    static const char *const names[6] = {"size_vector", "size_src", "starts", "ends", "raw", "aligned"};
    array a[6];
    PyObject *result = NULL;
    int64_t *delta = NULL;
    if (take_all(o, a, 6, names, 4) < 0)
        goto done;
    Py_ssize_t n = a[1].len;
    if (a[2].len != n || a[3].len != n || a[4].len != n || a[5].len != n || alignment < 1 || alignment > (1 << 30)) {
        PyErr_SetString(PyExc_ValueError, "size_src, starts, ends, raw and aligned differ in length, or bad alignment");
        goto done;
    }
    const int64_t *vector = a[0].data, *src = a[1].data, *starts = a[2].data, *ends = a[3].data;
    int64_t *raw = a[4].data, *aligned = a[5].data, last = -1, smallest = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (src[i] < 0 || src[i] >= a[0].len || starts[i] < 0 || ends[i] < starts[i]) {
            PyErr_Format(PyExc_ValueError, "block %zd: bad size index or range", i);
            goto done;
        }
        int64_t r = vector[src[i]];
        if (r < 0 || r > LIMIT) {
            PyErr_Format(SizeError, "block %zd has %lld bytes", i, (long long)r);
            goto done;
        }
        raw[i] = r;
        aligned[i] = (r + alignment - 1) / alignment * alignment;
        if (aligned[i] > 0 && (smallest == 0 || aligned[i] < smallest))
            smallest = aligned[i];
        if (ends[i] > last)
            last = ends[i];
    }
    if (last >= ((int64_t)1) << 32) {
        PyErr_Format(PyExc_ValueError, "a block ends at position %lld", (long long)last);
        goto done;
    }
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (pad && aligned[i] == 0)
            aligned[i] = smallest > 0 ? smallest : 1;
        if (aligned[i] > LIMIT - total) {
            PyErr_SetString(SizeError, "sizes add up to more than 2**62 bytes");
            goto done;
        }
        total += aligned[i];
    }
    delta = PyMem_RawCalloc((size_t)(last + 2), sizeof(int64_t));
    if (delta == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        delta[starts[i]] += aligned[i];
        delta[ends[i] + 1] -= aligned[i];
    }
    int64_t live = 0, bound = 0;
    for (int64_t t = 0; t <= last; t++) {
        live += delta[t];
        bound = live > bound ? live : bound;
    }
    result = Py_BuildValue("LL", (long long)total, (long long)bound);
done:
    PyMem_RawFree(delta);
    release(a, 6);
    return result;
}

PyDoc_STRVAR(scatter_doc,
"scatter(offsets, raw, n_tensors, tensors, tensor_blocks, scratch_pos, tensor_offsets, scratch_offsets,\n"
"        scratch_nbytes)\n\n"
"A kind's block offsets into a key plan's arrays: tensor_offsets[tensors[k]] =\n"
"offsets[tensor_blocks[k]]; for the scratch blocks (those after the first ``n_tensors``),\n"
"scratch_offsets[scratch_pos[j]] and scratch_nbytes[scratch_pos[j]] from offsets and raw.");

static PyObject *scatter(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[8];
    Py_ssize_t n_tensors;
    if (!PyArg_ParseTuple(args, "OOnOOOOOO:scatter", &o[0], &o[1], &n_tensors, &o[2], &o[3], &o[4], &o[5], &o[6],
                          &o[7]))
        return NULL;
    static const char *const names[8] = {"offsets", "raw", "tensors", "tensor_blocks", "scratch_pos",
                                         "tensor_offsets", "scratch_offsets", "scratch_nbytes"};
    array a[8];
    PyObject *result = NULL;
    if (take_all(o, a, 8, names, 5) < 0)
        goto done;
    Py_ssize_t n = a[0].len, n_scratch = a[4].len;
    if (a[1].len != n || n_tensors < 0 || n_tensors + n_scratch != n || a[3].len != a[2].len ||
        a[7].len != a[6].len) {
        PyErr_SetString(PyExc_ValueError, "scatter: arrays of inconsistent lengths");
        goto done;
    }
    for (Py_ssize_t k = 0; k < a[2].len; k++) {
        if (a[2].data[k] < 0 || a[2].data[k] >= a[5].len || a[3].data[k] < 0 || a[3].data[k] >= n_tensors) {
            PyErr_Format(PyExc_ValueError, "scatter: tensor entry %zd out of range", k);
            goto done;
        }
    }
    for (Py_ssize_t j = 0; j < n_scratch; j++) {
        if (a[4].data[j] < 0 || a[4].data[j] >= a[6].len) {
            PyErr_Format(PyExc_ValueError, "scatter: scratch entry %zd out of range", j);
            goto done;
        }
    }
    for (Py_ssize_t k = 0; k < a[2].len; k++)
        a[5].data[a[2].data[k]] = a[0].data[a[3].data[k]];
    for (Py_ssize_t j = 0; j < n_scratch; j++) {
        a[6].data[a[4].data[j]] = a[0].data[n_tensors + j];
        a[7].data[a[4].data[j]] = a[1].data[n_tensors + j];
    }
    result = Py_NewRef(Py_None);
done:
    release(a, 8);
    return result;
}

/* -- orders ----------------------------------------------------------------------------------- */

PyDoc_STRVAR(stable_order_doc,
"stable_order(keys, descending, ranks, out)\n\n"
"The blocks sorted by ``keys`` (ascending, or descending), equal keys in the order of ``ranks``\n"
"(a permutation: block i comes at rank ranks[i]) or, with ranks None, of their index; into ``out``.\n"
"The same order as numpy's stable argsort, by an LSD radix sort that skips the bytes all keys share\n"
"(sizes and offsets use a few of their eight).");

static PyObject *stable_order(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o_keys, *o_ranks, *o_out;
    int descending;
    if (!PyArg_ParseTuple(args, "OpOO:stable_order", &o_keys, &descending, &o_ranks, &o_out))
        return NULL;
    array a[3];
    memset(a, 0, sizeof a);
    PyObject *result = NULL;
    void *work = NULL;
    if (take(o_keys, &a[0], 0, "keys") < 0 || (o_ranks != Py_None && take(o_ranks, &a[1], 0, "ranks") < 0) ||
        take(o_out, &a[2], 1, "out") < 0)
        goto done;
    Py_ssize_t n = a[0].len;
    if (a[2].len != n || (a[1].held && a[1].len != n)) {
        PyErr_SetString(PyExc_ValueError, "keys, ranks and out differ in length");
        goto done;
    }
    work = PyMem_RawMalloc((size_t)n * 2 * sizeof(uint64_t) + (size_t)n + 1);
    if (work == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    uint64_t *ukey = work;
    int64_t *cur = a[2].data, *tmp = (int64_t *)(ukey + n);
    unsigned char *seen = (unsigned char *)(tmp + n);
    if (a[1].held) { /* start from the blocks in rank order */
        memset(seen, 0, (size_t)n);
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t r = a[1].data[i];
            if (r < 0 || r >= n || seen[r]) {
                PyErr_SetString(PyExc_ValueError, "ranks is not a permutation");
                goto done;
            }
            seen[r] = 1;
            cur[r] = i;
        }
    } else {
        for (Py_ssize_t i = 0; i < n; i++)
            cur[i] = i;
    }
    /* Signed order as unsigned order (flip the sign bit); descending is the complement. */
    uint64_t all_or = 0, all_and = ~(uint64_t)0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t u = (uint64_t)a[0].data[i] ^ ((uint64_t)1 << 63);
        ukey[i] = descending ? ~u : u;
        all_or |= ukey[i];
        all_and &= ukey[i];
    }
    uint64_t varying = all_or ^ all_and; /* bits that differ between some keys */
    for (int shift = 0; shift < 64; shift += 8) {
        if (((varying >> shift) & 0xff) == 0)
            continue; /* every key has the same byte here: the pass would change nothing */
        Py_ssize_t count[257] = {0};
        for (Py_ssize_t k = 0; k < n; k++)
            count[((ukey[cur[k]] >> shift) & 0xff) + 1]++;
        for (int b = 0; b < 256; b++)
            count[b + 1] += count[b];
        for (Py_ssize_t k = 0; k < n; k++)
            tmp[count[(ukey[cur[k]] >> shift) & 0xff]++] = cur[k];
        memcpy(cur, tmp, (size_t)n * sizeof(int64_t));
    }
    result = Py_NewRef(Py_None);
done:
    PyMem_RawFree(work);
    release(a, 3);
    return result;
}

static PyMethodDef methods[] = {
    {"stable_order", stable_order, METH_VARARGS, stable_order_doc},
    {"key_sizes", key_sizes, METH_VARARGS, key_sizes_doc},
    {"kind_sizes", kind_sizes, METH_VARARGS, kind_sizes_doc},
    {"scatter", scatter, METH_VARARGS, scatter_doc},
    {"live_peak", live_peak, METH_VARARGS, live_peak_doc},
    {"plan", plan, METH_VARARGS, plan_doc},
    {"replay", replay, METH_VARARGS, replay_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "engine.runtime._planner",
    "Compiled passes of the memory planner: best-fit, replay, lower bound, a key's sizes (optional; same results).",
    -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__planner(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    SizeError = PyErr_NewExceptionWithDoc("engine.runtime._planner.SizeError",
                                          "Sizes the compiled passes do not take (negative, or over 2**62 in all).",
                                          PyExc_ValueError, NULL);
    if (SizeError == NULL || PyModule_AddObjectRef(m, "SizeError", SizeError) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
