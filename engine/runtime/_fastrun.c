/* The native run path (issue 16): a prepared run as one compiled call.
 *
 * Why C: on a backend whose launches are C function pointers (the CPU plugin), the Python fast
 * path spends ~15 bare ctypes calls' worth of interpreter time around one kernel (binding, output
 * allocation, patching, wrapping). Here the same steps are a few dozen machine instructions:
 *
 *   NativeLane.run(inputs, outputs)   one thread's lane: checks numpy inputs against the graph's
 *                                     input specs, binds the symbols, finds the key's KeyRun and
 *                                     runs it; returns None (never an error) whenever anything is
 *                                     not the plain case, and the caller then takes the Python path,
 *                                     which raises the usual InputError (same errors by construction);
 *   KeyRun.run_bound(ptrs, storages)  one key's launches, inputs already bound (the Python path's
 *                                     prepared run delegates to it);
 *   KeyRun.launch(stream=None)        the launches alone, on the addresses last patched (a
 *                                     captured graph's replay).
 *
 * The launches run with the GIL released (kernels are reentrant by the CPU ABI). Outputs come from
 * a pool of one buffer per output slot of the key (the KeyRun belongs to one thread's lane): a
 * pooled tensor is handed out again only when the pool holds the only references to it, its
 * storage, the storage's memoryview (and the view's managed buffer, which arrays made from the view
 * share) and its owner (reference counts back at what they were when the pool made them, and no
 * weak references), so a buffer the caller still holds in any form is never written under it.
 *
 * The numpy array fields are read through numpy's stable struct layout (PyArrayObject_fields:
 * data, nd, dimensions, strides, base, descr, flags), as engine.hostptr does for the data pointer;
 * engine.runtime.native checks the layout at import on probe arrays (``probe``) and does not use
 * this module when it does not match.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#ifdef Py_GIL_DISABLED
/* The pool's "nobody else holds it" test reads reference counts under the GIL. */
#error "the native run path needs an interpreter with the GIL (the Python path runs elsewhere)"
#endif
#include <stdint.h>
#include <string.h>

#define MAX_INPUTS 32
#define MAX_SYMBOLS 32
#define MAX_OUTPUTS 32
#define NPY_C_CONTIGUOUS 0x0001
#define NPY_WRITEABLE 0x0400

typedef int32_t (*kernel_fn)(void *const *tensors, const int64_t *symbols, void *workspace);

typedef struct {
    PyObject_HEAD
    char *data;
    int nd;
    Py_ssize_t *dimensions;
    Py_ssize_t *strides;
    PyObject *base;
    PyObject *descr;
    int flags;
} ArrayFields;

static PyObject *str_ptr, *str_host_view, *str_owner, *kwnames_registry;

/* -- helpers ------------------------------------------------------------------------------------ */

static int unshared(PyObject *o, Py_ssize_t base)
{
    if (o == Py_None)
        return 1;
    if (Py_REFCNT(o) != base)
        return 0;
    Py_ssize_t off = Py_TYPE(o)->tp_weaklistoffset;
    if (off > 0 && *(PyObject **)((char *)o + off) != NULL)
        return 0;
    return 1;
}

/* A memoryview's managed buffer: views made from the view (np.frombuffer, slicing) share it
 * without referencing the view object itself, so its reference count is watched too. */
static PyObject *managed_buffer(PyObject *view)
{
    return PyMemoryView_Check(view) ? (PyObject *)((PyMemoryViewObject *)view)->mbuf : NULL;
}

static int buffer_unshared(PyObject *view, Py_ssize_t base)
{
    PyObject *mbuf = managed_buffer(view);
    return mbuf == NULL || Py_REFCNT(mbuf) == base;
}

static int read_ptr(PyObject *obj, void **out)
{
    void *p = PyLong_AsVoidPtr(obj);
    if (p == NULL && PyErr_Occurred())
        return -1;
    *out = p;
    return 0;
}

static int storage_ptr(PyObject *storage, void **out)
{
    PyObject *ptr = PyObject_GetAttr(storage, str_ptr);
    if (ptr == NULL)
        return -1;
    int rc = read_ptr(ptr, out);
    Py_DECREF(ptr);
    return rc;
}

/* Tuple of ints -> newly allocated array (n_out set); NULL with an error on failure. */
static void **address_array(PyObject *seq, Py_ssize_t *n_out, const char *what)
{
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    void **out = PyMem_Calloc(n ? n : 1, sizeof(void *));
    if (out == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (read_ptr(PySequence_Fast_GET_ITEM(fast, i), &out[i]) < 0) {
            PyMem_Free(out);
            Py_DECREF(fast);
            return NULL;
        }
    }
    Py_DECREF(fast);
    *n_out = n;
    return out;
}

/* Tuple of tuples of addresses -> CSR (offsets of length n + 1, flat addresses). */
static int csr(PyObject *seq, Py_ssize_t *n_out, Py_ssize_t **off_out, void ****flat_out, const char *what)
{
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast), total = 0;
    Py_ssize_t *off = PyMem_Calloc(n + 1, sizeof(Py_ssize_t));
    void ***flat = NULL;
    if (off == NULL)
        goto nomem;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t len = PyObject_Length(PySequence_Fast_GET_ITEM(fast, i));
        if (len < 0)
            goto fail;
        total += len;
        off[i + 1] = total;
    }
    flat = PyMem_Calloc(total ? total : 1, sizeof(void **));
    if (flat == NULL)
        goto nomem;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t count;
        void **addrs = address_array(PySequence_Fast_GET_ITEM(fast, i), &count, what);
        if (addrs == NULL)
            goto fail;
        for (Py_ssize_t j = 0; j < count; j++)
            flat[off[i] + j] = (void **)addrs[j];
        PyMem_Free(addrs);
    }
    Py_DECREF(fast);
    *n_out = n;
    *off_out = off;
    *flat_out = flat;
    return 0;
nomem:
    PyErr_NoMemory();
fail:
    PyMem_Free(off);
    PyMem_Free(flat);
    Py_DECREF(fast);
    return -1;
}

/* -- KeyRun ------------------------------------------------------------------------------------- */

typedef struct {
    PyObject *allocate; /* () -> Storage (the backend's prepared allocation) */
    PyObject *external; /* (ndarray) -> Storage over a caller's buffer */
    PyObject *dtype;    /* engine DType of the output */
    PyObject *shape;    /* tuple */
    PyObject *descr;    /* numpy dtype the caller's buffer must have */
    int nd;
    Py_ssize_t dims[MAX_SYMBOLS];
    /* pooled fresh output */
    PyObject *tensor, *storage, *view, *owner;
    Py_ssize_t rt, rs, rv, ro, rm;
    void *ptr;
    /* the caller's buffer seen last (outputs=) */
    PyObject *arr, *etensor, *estorage, *eview;
    Py_ssize_t ert, ers, erv;
} Slot;

typedef struct {
    PyObject_HEAD
    Py_ssize_t n;
    void **fns, **tensors, **symbols, **workspaces;
    Py_ssize_t n_inputs, *in_off;
    void ***in_patch;
    Py_ssize_t n_slots, *out_off;
    void ***out_patch;
    Slot *slots;
    Py_ssize_t n_outputs;
    Py_ssize_t out_slot[MAX_OUTPUTS];
    PyObject *tensor_type, *registry, *fail, *keep, *on_stream;
    Py_ssize_t runs; /* native runs made (all three entry points) */
} KeyRun;

static PyTypeObject KeyRunType;

static void slot_clear_pool(Slot *s)
{
    Py_CLEAR(s->tensor);
    Py_CLEAR(s->storage);
    Py_CLEAR(s->view);
    Py_CLEAR(s->owner);
    Py_CLEAR(s->arr);
    Py_CLEAR(s->etensor);
    Py_CLEAR(s->estorage);
    Py_CLEAR(s->eview);
}

static int keyrun_traverse(KeyRun *self, visitproc visit, void *arg)
{
    for (Py_ssize_t i = 0; self->slots && i < self->n_slots; i++) {
        Slot *s = &self->slots[i];
        Py_VISIT(s->allocate);
        Py_VISIT(s->external);
        Py_VISIT(s->dtype);
        Py_VISIT(s->shape);
        Py_VISIT(s->descr);
        Py_VISIT(s->tensor);
        Py_VISIT(s->storage);
        Py_VISIT(s->view);
        Py_VISIT(s->owner);
        Py_VISIT(s->arr);
        Py_VISIT(s->etensor);
        Py_VISIT(s->estorage);
        Py_VISIT(s->eview);
    }
    Py_VISIT(self->tensor_type);
    Py_VISIT(self->registry);
    Py_VISIT(self->fail);
    Py_VISIT(self->keep);
    Py_VISIT(self->on_stream);
    return 0;
}

static int keyrun_clear(KeyRun *self)
{
    for (Py_ssize_t i = 0; self->slots && i < self->n_slots; i++) {
        Slot *s = &self->slots[i];
        Py_CLEAR(s->allocate);
        Py_CLEAR(s->external);
        Py_CLEAR(s->dtype);
        Py_CLEAR(s->shape);
        Py_CLEAR(s->descr);
        slot_clear_pool(s);
    }
    Py_CLEAR(self->tensor_type);
    Py_CLEAR(self->registry);
    Py_CLEAR(self->fail);
    Py_CLEAR(self->keep);
    Py_CLEAR(self->on_stream);
    return 0;
}

static void keyrun_dealloc(KeyRun *self)
{
    PyObject_GC_UnTrack(self);
    keyrun_clear(self);
    PyMem_Free(self->fns);
    PyMem_Free(self->tensors);
    PyMem_Free(self->symbols);
    PyMem_Free(self->workspaces);
    PyMem_Free(self->in_off);
    PyMem_Free(self->in_patch);
    PyMem_Free(self->out_off);
    PyMem_Free(self->out_patch);
    PyMem_Free(self->slots);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* KeyRun(fns, tensors, symbols, workspaces, input_patches, slot_patches, slots, output_slots,
 *        tensor_type, registry, fail, keep)
 * slots: per output slot (allocate, external, dtype, shape, numpy_dtype). */
static int keyrun_init(KeyRun *self, PyObject *args, PyObject *kwds)
{
    PyObject *fns, *tensors, *symbols, *workspaces, *in_p, *out_p, *slots, *out_slots, *tensor_type, *registry,
        *fail, *keep;
    if (self->fns != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "KeyRun is initialised once");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOOO", &fns, &tensors, &symbols, &workspaces, &in_p, &out_p, &slots,
                          &out_slots, &tensor_type, &registry, &fail, &keep))
        return -1;
    Py_ssize_t n1, n2, n3, n4;
    if ((self->fns = address_array(fns, &n1, "fns")) == NULL ||
        (self->tensors = address_array(tensors, &n2, "tensors")) == NULL ||
        (self->symbols = address_array(symbols, &n3, "symbols")) == NULL ||
        (self->workspaces = address_array(workspaces, &n4, "workspaces")) == NULL)
        return -1;
    if (n1 != n2 || n1 != n3 || n1 != n4) {
        PyErr_SetString(PyExc_ValueError, "fns, tensors, symbols and workspaces differ in length");
        return -1;
    }
    self->n = n1;
    for (Py_ssize_t i = 0; i < n1; i++) {
        if (self->fns[i] == NULL || self->tensors[i] == NULL) {
            PyErr_Format(PyExc_ValueError, "launch %zd has a null function or tensor array", i);
            return -1;
        }
    }
    if (csr(in_p, &self->n_inputs, &self->in_off, &self->in_patch, "input_patches") < 0)
        return -1;
    if (csr(out_p, &self->n_slots, &self->out_off, &self->out_patch, "slot_patches") < 0)
        return -1;
    if (self->n_inputs > MAX_INPUTS) {
        PyErr_Format(PyExc_ValueError, "at most %d inputs", MAX_INPUTS);
        return -1;
    }
    PyObject *sf = PySequence_Fast(slots, "slots");
    if (sf == NULL)
        return -1;
    if (PySequence_Fast_GET_SIZE(sf) != self->n_slots) {
        Py_DECREF(sf);
        PyErr_SetString(PyExc_ValueError, "slots and slot_patches differ in length");
        return -1;
    }
    self->slots = PyMem_Calloc(self->n_slots ? self->n_slots : 1, sizeof(Slot));
    if (self->slots == NULL) {
        Py_DECREF(sf);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < self->n_slots; i++) {
        Slot *s = &self->slots[i];
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(sf, i), "OOOO!O;a slot is (allocate, external, dtype, "
                              "shape, numpy_dtype)", &s->allocate, &s->external, &s->dtype, &PyTuple_Type,
                              &s->shape, &s->descr)) {
            s->allocate = s->external = s->dtype = s->shape = s->descr = NULL;
            Py_DECREF(sf);
            return -1;
        }
        Py_INCREF(s->allocate);
        Py_INCREF(s->external);
        Py_INCREF(s->dtype);
        Py_INCREF(s->shape);
        Py_INCREF(s->descr);
        Py_ssize_t nd = PyTuple_GET_SIZE(s->shape);
        if (nd > MAX_SYMBOLS) {
            Py_DECREF(sf);
            PyErr_Format(PyExc_ValueError, "outputs of at most %d dimensions", MAX_SYMBOLS);
            return -1;
        }
        s->nd = (int)nd;
        for (Py_ssize_t d = 0; d < nd; d++) {
            s->dims[d] = PyLong_AsSsize_t(PyTuple_GET_ITEM(s->shape, d));
            if (s->dims[d] == -1 && PyErr_Occurred()) {
                Py_DECREF(sf);
                return -1;
            }
        }
    }
    Py_DECREF(sf);
    PyObject *of = PySequence_Fast(out_slots, "output_slots");
    if (of == NULL)
        return -1;
    self->n_outputs = PySequence_Fast_GET_SIZE(of);
    if (self->n_outputs > MAX_OUTPUTS || self->n_outputs != self->n_slots) {
        Py_DECREF(of);
        PyErr_Format(PyExc_ValueError, "one slot per output (at most %d)", MAX_OUTPUTS);
        return -1;
    }
    for (Py_ssize_t k = 0; k < self->n_outputs; k++) {
        Py_ssize_t s = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(of, k));
        if (s < 0 || s >= self->n_slots) {
            Py_DECREF(of);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "output slot out of range");
            return -1;
        }
        self->out_slot[k] = s;
    }
    Py_DECREF(of);
    Py_INCREF(tensor_type);
    self->tensor_type = tensor_type;
    Py_INCREF(registry);
    self->registry = registry;
    Py_INCREF(fail);
    self->fail = fail;
    Py_INCREF(keep);
    self->keep = keep;
    Py_INCREF(Py_None);
    self->on_stream = Py_None;
    return 0;
}

/* Run every launch (GIL released); on a failing kernel call fail(position, code), which raises. */
static int launch_all(KeyRun *self)
{
    Py_ssize_t n = self->n, failed = 0;
    int32_t code = 0;
    void **fns = self->fns, **tensors = self->tensors, **symbols = self->symbols, **ws = self->workspaces;
    self->runs++;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        kernel_fn fn;
        memcpy(&fn, &fns[i], sizeof fn);
        code = fn((void *const *)tensors[i], (const int64_t *)symbols[i], ws[i]);
        if (code != 0) {
            failed = i + 1;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    if (failed) {
        PyObject *r = PyObject_CallFunction(self->fail, "ni", failed, (int)code);
        if (r != NULL) {
            Py_DECREF(r);
            PyErr_Format(PyExc_RuntimeError, "launch %zd failed with code %d", failed, (int)code);
        }
        return -1;
    }
    return 0;
}

static PyObject *make_tensor(KeyRun *self, Slot *s, PyObject *storage)
{
    PyObject *zero = PyLong_FromLong(0);
    if (zero == NULL)
        return NULL;
    PyObject *args[5] = {storage, s->dtype, s->shape, zero, self->registry};
    PyObject *t = PyObject_Vectorcall(self->tensor_type, args, 4, kwnames_registry);
    Py_DECREF(zero);
    return t;
}

/* A fresh output of slot s (pooled when nobody else holds the last one); sets s->ptr. Borrowed result. */
static PyObject *pooled_output(KeyRun *self, Slot *s, Py_ssize_t slot_index, int *alloc_failed)
{
    if (s->tensor != NULL && unshared(s->tensor, s->rt) && unshared(s->storage, s->rs) &&
        unshared(s->view, s->rv) && unshared(s->owner, s->ro) && buffer_unshared(s->view, s->rm))
        return s->tensor;
    PyObject *storage = PyObject_CallNoArgs(s->allocate);
    if (storage == NULL) {
        *alloc_failed = PyErr_ExceptionMatches(PyExc_MemoryError);
        return NULL;
    }
    void *ptr;
    PyObject *view = NULL, *owner = NULL, *tensor = NULL;
    if (storage_ptr(storage, &ptr) < 0 || (view = PyObject_GetAttr(storage, str_host_view)) == NULL ||
        (owner = PyObject_GetAttr(storage, str_owner)) == NULL || (tensor = make_tensor(self, s, storage)) == NULL) {
        Py_DECREF(storage);
        Py_XDECREF(view);
        Py_XDECREF(owner);
        return NULL;
    }
    Py_XDECREF(s->tensor);
    Py_XDECREF(s->storage);
    Py_XDECREF(s->view);
    Py_XDECREF(s->owner);
    s->tensor = tensor;
    s->storage = storage;
    s->view = view;
    s->owner = owner;
    s->rt = Py_REFCNT(tensor);
    s->rs = Py_REFCNT(storage);
    s->rv = Py_REFCNT(view);
    s->ro = Py_REFCNT(owner);
    s->rm = managed_buffer(view) ? Py_REFCNT(managed_buffer(view)) : 0;
    s->ptr = ptr;
    (void)slot_index;
    return tensor;
}

/* The caller's array as slot s's output (cached while the caller passes the same array). Borrowed. */
static PyObject *caller_output(KeyRun *self, Slot *s, PyObject *arr)
{
    if (s->arr == arr && unshared(s->etensor, s->ert) && unshared(s->estorage, s->ers) && unshared(s->eview, s->erv))
        return s->etensor;
    PyObject *storage = PyObject_CallOneArg(s->external, arr);
    if (storage == NULL)
        return NULL;
    PyObject *view = PyObject_GetAttr(storage, str_host_view), *tensor = NULL;
    if (view == NULL || (tensor = make_tensor(self, s, storage)) == NULL) {
        Py_DECREF(storage);
        Py_XDECREF(view);
        return NULL;
    }
    Py_INCREF(arr);
    Py_XDECREF(s->arr);
    Py_XDECREF(s->etensor);
    Py_XDECREF(s->estorage);
    Py_XDECREF(s->eview);
    s->arr = arr;
    s->etensor = tensor;
    s->estorage = storage;
    s->eview = view;
    s->ert = Py_REFCNT(tensor);
    s->ers = Py_REFCNT(storage);
    s->erv = Py_REFCNT(view);
    return tensor;
}

/* Patch inputs, bind outputs (pool, caller arrays, or caller storages), launch, wrap.
 * Returns a new list, NULL with an error, or NULL without one when an allocation failed
 * (*alloc_failed = slot + 1: the caller decides how to report it). */
static PyObject *keyrun_execute(KeyRun *self, void *const *in_addrs, PyObject *const *out_arrays,
                                PyObject *out_storages, Py_ssize_t *alloc_failed)
{
    PyObject *made[MAX_OUTPUTS];
    Py_ssize_t n_made = 0;
    for (Py_ssize_t i = 0; i < self->n_inputs; i++) {
        void *ptr = in_addrs[i];
        for (Py_ssize_t j = self->in_off[i]; j < self->in_off[i + 1]; j++)
            *self->in_patch[j] = ptr;
    }
    for (Py_ssize_t i = 0; i < self->n_slots; i++) {
        Slot *s = &self->slots[i];
        PyObject *t;
        void *ptr;
        if (out_storages != NULL) {
            PyObject *storage = PyList_GET_ITEM(out_storages, i);
            if (storage_ptr(storage, &ptr) < 0 || (t = make_tensor(self, s, storage)) == NULL)
                goto fail;
            made[n_made++] = t;
        } else if (out_arrays != NULL) {
            if ((t = caller_output(self, s, out_arrays[i])) == NULL)
                goto fail;
            ptr = ((ArrayFields *)out_arrays[i])->data;
            Py_INCREF(t);
            made[n_made++] = t;
        } else {
            int oom = 0;
            if ((t = pooled_output(self, s, i, &oom)) == NULL) {
                if (oom)
                    *alloc_failed = i + 1;
                goto fail;
            }
            ptr = s->ptr;
            Py_INCREF(t);
            made[n_made++] = t;
        }
        for (Py_ssize_t j = self->out_off[i]; j < self->out_off[i + 1]; j++)
            *self->out_patch[j] = ptr;
    }
    if (launch_all(self) < 0)
        goto fail;
    PyObject *result = PyList_New(self->n_outputs);
    if (result == NULL)
        goto fail;
    for (Py_ssize_t k = 0; k < self->n_outputs; k++) {
        PyObject *t = made[self->out_slot[k]];
        Py_INCREF(t);
        PyList_SET_ITEM(result, k, t);
    }
    for (Py_ssize_t i = 0; i < n_made; i++)
        Py_DECREF(made[i]);
    return result;
fail:
    for (Py_ssize_t i = 0; i < n_made; i++)
        Py_DECREF(made[i]);
    return NULL;
}

/* run_bound(ptrs, storages_or_None, out_of_memory): the Python binder already bound the inputs. On a
 * failed allocation out_of_memory(exc, slot) is called with the MemoryError and must raise. */
static PyObject *keyrun_run_bound(KeyRun *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "run_bound(ptrs, storages, out_of_memory)");
        return NULL;
    }
    PyObject *ptrs = args[0], *storages = args[1];
    void *addrs[MAX_INPUTS];
    if (!PyList_Check(ptrs) || PyList_GET_SIZE(ptrs) != self->n_inputs) {
        PyErr_Format(PyExc_ValueError, "ptrs must be a list of %zd addresses", self->n_inputs);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < self->n_inputs; i++)
        if (read_ptr(PyList_GET_ITEM(ptrs, i), &addrs[i]) < 0)
            return NULL;
    if (storages == Py_None)
        storages = NULL;
    else if (!PyList_Check(storages) || PyList_GET_SIZE(storages) != self->n_slots) {
        PyErr_Format(PyExc_ValueError, "storages must be None or a list of %zd storages", self->n_slots);
        return NULL;
    }
    Py_ssize_t failed = 0;
    PyObject *result = keyrun_execute(self, addrs, NULL, storages, &failed);
    if (result == NULL && failed) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        if (tb != NULL)
            PyException_SetTraceback(value, tb);
        PyObject *r = PyObject_CallFunction(args[2], "On", value, failed - 1);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        if (r != NULL) {
            Py_DECREF(r);
            PyErr_SetString(PyExc_RuntimeError, "out_of_memory() must raise");
        }
    }
    return result;
}

static PyObject *keyrun_launch(KeyRun *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs > 1) {
        PyErr_SetString(PyExc_TypeError, "launch(stream=None)");
        return NULL;
    }
    if (nargs == 1 && args[0] != Py_None) {
        PyObject *r = PyObject_CallOneArg(self->on_stream, args[0]);
        if (r == NULL)
            return NULL;
        Py_DECREF(r);
    }
    if (launch_all(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef keyrun_methods[] = {
    {"run_bound", (PyCFunction)(void (*)(void))keyrun_run_bound, METH_FASTCALL,
     "run_bound(ptrs, storages, out_of_memory) -> list of output tensors (inputs bound by the caller)"},
    {"launch", (PyCFunction)(void (*)(void))keyrun_launch, METH_FASTCALL,
     "launch(stream=None): the launches alone, on the addresses last patched"},
    {NULL},
};

static PyMemberDef keyrun_members[] = {
    {"on_stream", T_OBJECT_EX, offsetof(KeyRun, on_stream), 0,
     "called with a stream passed to launch() (not None): raises when the launches cannot honour it"},
    {"runs", T_PYSSIZET, offsetof(KeyRun, runs), READONLY, "launch rounds made natively"},
    {"launches", T_PYSSIZET, offsetof(KeyRun, n), READONLY, "kernel launches per run"},
    {NULL},
};

static PyTypeObject KeyRunType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "engine.runtime._fastrun.KeyRun",
    .tp_basicsize = sizeof(KeyRun),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "One key's launches on one lane, with its output pool (see the module docstring).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)keyrun_init,
    .tp_dealloc = (destructor)keyrun_dealloc,
    .tp_traverse = (traverseproc)keyrun_traverse,
    .tp_clear = (inquiry)keyrun_clear,
    .tp_methods = keyrun_methods,
    .tp_members = keyrun_members,
};

/* -- NativeLane --------------------------------------------------------------------------------- */

typedef struct {
    PyObject *descr; /* borrowed from the lane's specs tuple */
    int usable;      /* numpy arrays are accepted for this input (it is on the CPU) */
    int rank;
    Py_ssize_t n_const, n_sym;
    Py_ssize_t const_dim[MAX_SYMBOLS], const_val[MAX_SYMBOLS];
    Py_ssize_t sym_dim[MAX_SYMBOLS], sym_idx[MAX_SYMBOLS];
} InSpec;

typedef struct {
    PyObject_HEAD
    PyObject *ndarray;
    PyObject *specs_keep;
    Py_ssize_t n_inputs, n_symbols, n_outputs;
    InSpec *specs;
    Py_ssize_t n_runs, cap;
    Py_ssize_t *keys; /* n_runs * n_symbols */
    KeyRun **runs;
} NativeLane;

static int lane_traverse(NativeLane *self, visitproc visit, void *arg)
{
    Py_VISIT(self->ndarray);
    Py_VISIT(self->specs_keep);
    for (Py_ssize_t i = 0; i < self->n_runs; i++)
        Py_VISIT(self->runs[i]);
    return 0;
}

static void lane_drop_runs(NativeLane *self)
{
    Py_ssize_t n = self->n_runs;
    self->n_runs = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        Py_CLEAR(self->runs[i]);
}

static int lane_clear(NativeLane *self)
{
    Py_CLEAR(self->ndarray);
    Py_CLEAR(self->specs_keep);
    lane_drop_runs(self);
    return 0;
}

static void lane_dealloc(NativeLane *self)
{
    PyObject_GC_UnTrack(self);
    lane_clear(self);
    PyMem_Free(self->specs);
    PyMem_Free(self->keys);
    PyMem_Free(self->runs);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int pairs(PyObject *seq, Py_ssize_t *n, Py_ssize_t *a, Py_ssize_t *b, const char *what)
{
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL)
        return -1;
    *n = PySequence_Fast_GET_SIZE(fast);
    if (*n > MAX_SYMBOLS) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "%s: at most %d", what, MAX_SYMBOLS);
        return -1;
    }
    for (Py_ssize_t i = 0; i < *n; i++) {
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "nn", &a[i], &b[i])) {
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    return 0;
}

/* NativeLane(ndarray_type, specs, n_symbols, n_outputs); specs: per input
 * (numpy_dtype, usable, rank, ((dim, constant), ...), ((dim, symbol), ...)). */
static int lane_init(NativeLane *self, PyObject *args, PyObject *kwds)
{
    PyObject *ndarray, *specs;
    Py_ssize_t n_symbols, n_outputs;
    if (self->specs != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "NativeLane is initialised once");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "O!O!nn", &PyType_Type, &ndarray, &PyTuple_Type, &specs, &n_symbols, &n_outputs))
        return -1;
    Py_ssize_t n = PyTuple_GET_SIZE(specs);
    if (n > MAX_INPUTS || n_symbols > MAX_SYMBOLS || n_symbols < 0 || n_outputs > MAX_OUTPUTS || n_outputs < 0) {
        PyErr_Format(PyExc_ValueError, "at most %d inputs, symbols and outputs", MAX_INPUTS);
        return -1;
    }
    self->specs = PyMem_Calloc(n ? n : 1, sizeof(InSpec));
    if (self->specs == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        InSpec *s = &self->specs[i];
        PyObject *consts, *syms;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(specs, i), "OpiOO", &s->descr, &s->usable, &s->rank, &consts, &syms))
            return -1;
        if (pairs(consts, &s->n_const, s->const_dim, s->const_val, "const dims") < 0 ||
            pairs(syms, &s->n_sym, s->sym_dim, s->sym_idx, "symbol dims") < 0)
            return -1;
        for (Py_ssize_t j = 0; j < s->n_sym; j++) {
            if (s->sym_idx[j] < 0 || s->sym_idx[j] >= n_symbols || s->sym_dim[j] < 0 || s->sym_dim[j] >= s->rank) {
                PyErr_SetString(PyExc_ValueError, "symbol dimension out of range");
                return -1;
            }
        }
    }
    Py_INCREF(ndarray);
    self->ndarray = ndarray;
    Py_INCREF(specs);
    self->specs_keep = specs;
    self->n_inputs = n;
    self->n_symbols = n_symbols;
    self->n_outputs = n_outputs;
    return 0;
}

/* add(key, keyrun): run keyrun for inputs that bind these symbol values. */
static PyObject *lane_add(NativeLane *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyTuple_Check(args[0]) || !PyObject_TypeCheck(args[1], &KeyRunType)) {
        PyErr_SetString(PyExc_TypeError, "add(key: tuple, run: KeyRun)");
        return NULL;
    }
    PyObject *key = args[0];
    KeyRun *run = (KeyRun *)args[1];
    if (PyTuple_GET_SIZE(key) != self->n_symbols || run->n_inputs != self->n_inputs ||
        run->n_outputs != self->n_outputs) {
        PyErr_SetString(PyExc_ValueError, "the key or the run does not fit this lane");
        return NULL;
    }
    Py_ssize_t values[MAX_SYMBOLS];
    for (Py_ssize_t j = 0; j < self->n_symbols; j++) {
        values[j] = PyLong_AsSsize_t(PyTuple_GET_ITEM(key, j));
        if (values[j] == -1 && PyErr_Occurred())
            return NULL;
    }
    Py_ssize_t at = self->n_runs;
    for (Py_ssize_t r = 0; r < self->n_runs; r++) {
        if (memcmp(&self->keys[r * self->n_symbols], values, self->n_symbols * sizeof(Py_ssize_t)) == 0) {
            at = r;
            break;
        }
    }
    if (at == self->n_runs) {
        if (self->n_runs == self->cap) {
            Py_ssize_t cap = self->cap ? self->cap * 2 : 4;
            Py_ssize_t *keys = PyMem_Realloc(self->keys, (cap * (self->n_symbols ? self->n_symbols : 1)) *
                                                             sizeof(Py_ssize_t));
            if (keys == NULL)
                return PyErr_NoMemory();
            self->keys = keys;
            KeyRun **runs = PyMem_Realloc(self->runs, cap * sizeof(KeyRun *));
            if (runs == NULL)
                return PyErr_NoMemory();
            self->runs = runs;
            self->cap = cap;
        }
        self->runs[at] = NULL;
        self->n_runs++;
    }
    if (self->n_symbols)
        memcpy(&self->keys[at * self->n_symbols], values, self->n_symbols * sizeof(Py_ssize_t));
    Py_INCREF(run);
    Py_XSETREF(self->runs[at], run);
    Py_RETURN_NONE;
}

static PyObject *lane_clear_runs(NativeLane *self, PyObject *unused)
{
    lane_drop_runs(self);
    Py_RETURN_NONE;
}

/* run(inputs, outputs): the whole run, or None when the Python path must take it (anything but
 * C-contiguous numpy arrays of the expected dtypes and shapes at a key this lane has prepared). */
static PyObject *lane_run(NativeLane *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2)
        Py_RETURN_NONE;
    PyObject *inputs = args[0], *outputs = args[1];
    PyObject *const *items;
    Py_ssize_t n;
    if (PyList_CheckExact(inputs)) {
        items = ((PyListObject *)inputs)->ob_item;
        n = PyList_GET_SIZE(inputs);
    } else if (PyTuple_CheckExact(inputs)) {
        items = ((PyTupleObject *)inputs)->ob_item;
        n = PyTuple_GET_SIZE(inputs);
    } else
        Py_RETURN_NONE;
    if (n != self->n_inputs)
        Py_RETURN_NONE;
    Py_ssize_t values[MAX_SYMBOLS];
    void *addrs[MAX_INPUTS];
    PyObject *held[MAX_INPUTS];
    for (Py_ssize_t j = 0; j < self->n_symbols; j++)
        values[j] = -1;
    PyTypeObject *ndarray = (PyTypeObject *)self->ndarray;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = items[i];
        InSpec *s = &self->specs[i];
        if (Py_TYPE(x) != ndarray || !s->usable)
            Py_RETURN_NONE;
        ArrayFields *a = (ArrayFields *)x;
        if (a->descr != s->descr || !(a->flags & NPY_C_CONTIGUOUS) || a->nd != s->rank)
            Py_RETURN_NONE;
        for (Py_ssize_t j = 0; j < s->n_const; j++)
            if (a->dimensions[s->const_dim[j]] != s->const_val[j])
                Py_RETURN_NONE;
        for (Py_ssize_t j = 0; j < s->n_sym; j++) {
            Py_ssize_t v = a->dimensions[s->sym_dim[j]], *bound = &values[s->sym_idx[j]];
            if (*bound < 0)
                *bound = v;
            else if (*bound != v)
                Py_RETURN_NONE;
        }
        addrs[i] = a->data;
    }
    KeyRun *run = NULL;
    for (Py_ssize_t r = 0; r < self->n_runs; r++) {
        if (memcmp(&self->keys[r * self->n_symbols], values, self->n_symbols * sizeof(Py_ssize_t)) == 0) {
            run = self->runs[r];
            break;
        }
    }
    if (run == NULL)
        Py_RETURN_NONE;
    PyObject *out_arrays[MAX_OUTPUTS];
    PyObject *const *outs = NULL;
    if (outputs != Py_None) {
        PyObject *const *oitems;
        Py_ssize_t no;
        if (PyList_CheckExact(outputs)) {
            oitems = ((PyListObject *)outputs)->ob_item;
            no = PyList_GET_SIZE(outputs);
        } else if (PyTuple_CheckExact(outputs)) {
            oitems = ((PyTupleObject *)outputs)->ob_item;
            no = PyTuple_GET_SIZE(outputs);
        } else
            Py_RETURN_NONE;
        if (no != run->n_outputs)
            Py_RETURN_NONE;
        for (Py_ssize_t k = 0; k < no; k++) {
            PyObject *o = oitems[k];
            Slot *s = &run->slots[run->out_slot[k]];
            if (Py_TYPE(o) != ndarray)
                Py_RETURN_NONE;
            ArrayFields *a = (ArrayFields *)o;
            if (a->descr != s->descr || (a->flags & (NPY_C_CONTIGUOUS | NPY_WRITEABLE)) !=
                                            (NPY_C_CONTIGUOUS | NPY_WRITEABLE) || a->nd != s->nd)
                Py_RETURN_NONE;
            for (int d = 0; d < s->nd; d++)
                if (a->dimensions[d] != s->dims[d])
                    Py_RETURN_NONE;
            out_arrays[run->out_slot[k]] = o;
        }
        outs = out_arrays;
    }
    /* The inputs (and the run) stay alive while the kernels read them, whatever other threads do
     * to the caller's list in the meantime. */
    for (Py_ssize_t i = 0; i < n; i++) {
        held[i] = items[i];
        Py_INCREF(held[i]);
    }
    Py_INCREF(run);
    if (outs != NULL)
        for (Py_ssize_t k = 0; k < run->n_outputs; k++)
            Py_INCREF(out_arrays[k]);
    Py_ssize_t failed = 0;
    PyObject *result = keyrun_execute(run, addrs, outs, NULL, &failed);
    if (result == NULL && failed) {
        PyErr_Clear(); /* the Python path allocates again and reports it with the output's purpose */
        Py_INCREF(Py_None);
        result = Py_None;
    }
    if (outs != NULL)
        for (Py_ssize_t k = 0; k < run->n_outputs; k++)
            Py_DECREF(out_arrays[k]);
    Py_DECREF(run);
    for (Py_ssize_t i = 0; i < n; i++)
        Py_DECREF(held[i]);
    return result;
}

static PyObject *lane_len(NativeLane *self, PyObject *unused)
{
    return PyLong_FromSsize_t(self->n_runs);
}

static PyMethodDef lane_methods[] = {
    {"run", (PyCFunction)(void (*)(void))lane_run, METH_FASTCALL,
     "run(inputs, outputs) -> list of output tensors, or None: take the Python path"},
    {"add", (PyCFunction)(void (*)(void))lane_add, METH_FASTCALL, "add(key, run): the KeyRun for this key"},
    {"clear", (PyCFunction)lane_clear_runs, METH_NOARGS, "drop every KeyRun (workspaces moved)"},
    {"keys", (PyCFunction)lane_len, METH_NOARGS, "how many keys this lane runs natively"},
    {NULL},
};

static PyTypeObject NativeLaneType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "engine.runtime._fastrun.NativeLane",
    .tp_basicsize = sizeof(NativeLane),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "One thread's lane: input checks, key lookup and the key's KeyRun (see the module docstring).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)lane_init,
    .tp_dealloc = (destructor)lane_dealloc,
    .tp_traverse = (traverseproc)lane_traverse,
    .tp_clear = (inquiry)lane_clear,
    .tp_methods = lane_methods,
};

/* -- module ------------------------------------------------------------------------------------- */

/* probe(array) -> (data, nd, shape, descr, c_contiguous, writeable) as read through the struct layout. */
static PyObject *probe(PyObject *mod, PyObject *arr)
{
    ArrayFields *a = (ArrayFields *)arr;
    if (a->nd < 0 || a->nd > 64) {
        PyErr_SetString(PyExc_ValueError, "implausible rank: the layout does not match");
        return NULL;
    }
    PyObject *shape = PyTuple_New(a->nd);
    if (shape == NULL)
        return NULL;
    for (int d = 0; d < a->nd; d++)
        PyTuple_SET_ITEM(shape, d, PyLong_FromSsize_t(a->dimensions[d]));
    return Py_BuildValue("(NiNOii)", PyLong_FromVoidPtr(a->data), a->nd, shape, a->descr,
                         (a->flags & NPY_C_CONTIGUOUS) != 0, (a->flags & NPY_WRITEABLE) != 0);
}

static PyMethodDef module_methods[] = {
    {"probe", probe, METH_O, "probe(ndarray): its fields as this module reads them (layout check)"},
    {NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "engine.runtime._fastrun",
    "The native run path of prepared runs (issue 16); see engine/runtime/native.py.", -1, module_methods,
};

PyMODINIT_FUNC PyInit__fastrun(void)
{
    if (PyType_Ready(&KeyRunType) < 0 || PyType_Ready(&NativeLaneType) < 0)
        return NULL;
    str_ptr = PyUnicode_InternFromString("ptr");
    str_host_view = PyUnicode_InternFromString("host_view");
    str_owner = PyUnicode_InternFromString("owner");
    kwnames_registry = Py_BuildValue("(s)", "registry");
    if (!str_ptr || !str_host_view || !str_owner || !kwnames_registry)
        return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    Py_INCREF(&KeyRunType);
    Py_INCREF(&NativeLaneType);
    if (PyModule_AddObject(m, "KeyRun", (PyObject *)&KeyRunType) < 0 ||
        PyModule_AddObject(m, "NativeLane", (PyObject *)&NativeLaneType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
