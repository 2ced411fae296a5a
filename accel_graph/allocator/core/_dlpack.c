/* A one-call maker of CPU tensors over allocator-engine blocks, through DLPack.
 *
 * make(engine, key, dtype_code, dtype_bits, shape, stride) allocates the block the tensor needs
 * from the engine (ag_tensor_alloc), fills a DLManagedTensor over it (the shape and strides live
 * in the same heap struct) and hands a "dltensor" capsule to torch's DLPack importer, returning
 * the tensor. The block belongs to the tensor: the DLPack deleter, which torch calls when the
 * tensor's storage dies (from any thread, with or without the GIL), calls ag_tensor_release,
 * which frees the block under the engine's mutex and touches nothing of Python's.
 *
 * The engine functions come from the cffi core (_core) as addresses passed to bind(): this
 * module is a plain CPython extension only because cffi cannot return a PyObject.
 * Limited API (abi3), Python >= 3.10. Docs: docs/allocator.md "Tensor blocks".
 */
#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x030A0000
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

/* DLPack (dlpack.h v0.8, the unversioned "dltensor" ABI every torch imports) */
typedef struct { int32_t device_type; int32_t device_id; } DLDevice;
typedef struct { uint8_t code; uint8_t bits; uint16_t lanes; } DLDataType;
typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides;
    uint64_t byte_offset;
} DLTensor;
typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;
enum { kDLCPU = 1 };

#define MAX_DIMS 64

typedef int64_t (*alloc_fn)(void *engine, int64_t size);
typedef void (*release_fn)(void *engine, uint64_t ptr, int64_t key);
typedef int64_t (*drain_fn)(void *engine, int64_t *out, int64_t max);

static alloc_fn core_alloc;
static release_fn core_release;
static drain_fn core_drain;
static PyObject *importer; /* torch._C._from_dlpack (or torch.utils.dlpack.from_dlpack) */

typedef struct {
    DLManagedTensor m;
    void *engine;
    PyObject *owner; /* kept alive with the block (the pool), or NULL */
    int64_t key;
    int64_t dims[]; /* shape[ndim], then strides[ndim] */
} holder;

/* torch may call this without the GIL, from any thread: the block goes back under the
 * engine's mutex first, then the owner is released with the GIL taken for it (after the
 * interpreter is gone, the reference is left: there is nothing to release it to). */
static void deleter(DLManagedTensor *m) {
    holder *h = (holder *)m;
    PyObject *owner = h->owner;
    core_release(h->engine, (uint64_t)(uintptr_t)m->dl_tensor.data, h->key);
    free(h);
    if (owner && Py_IsInitialized()) {
        PyGILState_STATE g = PyGILState_Ensure();
        Py_DECREF(owner);
        PyGILState_Release(g);
    }
}

static void capsule_destructor(PyObject *cap) {
    /* consumed capsules are renamed "used_dltensor" by the importer: only an unconsumed one
     * (the import failed) still owns its tensor */
    /* (PyCapsule_IsValid cannot fail, so an exception in flight is left alone) */
    if (PyCapsule_IsValid(cap, "dltensor")) {
        DLManagedTensor *m = PyCapsule_GetPointer(cap, "dltensor");
        if (m && m->deleter) m->deleter(m);
    }
}

/* dims from a tuple or any sequence of ints; returns ndim or -1 */
static int read_dims(PyObject *seq, int64_t *out, const char *what) {
    PyObject *t = PyTuple_Check(seq) ? (Py_INCREF(seq), seq) : PySequence_Tuple(seq);
    if (!t) return -1;
    Py_ssize_t n = PyTuple_Size(t);
    if (n > MAX_DIMS) {
        Py_DECREF(t);
        PyErr_Format(PyExc_ValueError, "%s: at most %d dimensions", what, MAX_DIMS);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v = PyLong_AsLongLong(PyTuple_GetItem(t, i));
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(t);
            return -1;
        }
        if (v < 0) {
            Py_DECREF(t);
            PyErr_Format(PyExc_ValueError, "%s: negative entry %lld", what, v);
            return -1;
        }
        out[i] = (int64_t)v;
    }
    Py_DECREF(t);
    return (int)n;
}

static PyObject *bind(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "bind(alloc_addr, release_addr, drain_addr, importer)");
        return NULL;
    }
    void *a = PyLong_AsVoidPtr(args[0]);
    void *r = a ? PyLong_AsVoidPtr(args[1]) : NULL;
    void *d = r ? PyLong_AsVoidPtr(args[2]) : NULL;
    if (!a || !r || !d) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "null function address");
        return NULL;
    }
    if (!PyCallable_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "importer must be callable");
        return NULL;
    }
    core_alloc = (alloc_fn)a;
    core_release = (release_fn)r;
    core_drain = (drain_fn)d;
    PyObject *old = importer;
    Py_INCREF(args[3]);
    importer = args[3];
    Py_XDECREF(old);
    Py_RETURN_NONE;
}

/* make(engine_addr, key, code, bits, shape, stride, owner) -> tensor, or an int < 0 (the
 * engine's status; the reason is ag_last_error on this thread) when the block cannot be had.
 * owner (None: nothing) is referenced until the tensor dies. */
static PyObject *make(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "make(engine, key, code, bits, shape, stride, owner)");
        return NULL;
    }
    if (!importer) {
        PyErr_SetString(PyExc_RuntimeError, "_dlpack.bind() was not called");
        return NULL;
    }
    void *engine = PyLong_AsVoidPtr(args[0]);
    if (!engine) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "null engine");
        return NULL;
    }
    long long key = PyLong_AsLongLong(args[1]);
    long code = PyLong_AsLong(args[2]);
    long bits = PyLong_AsLong(args[3]);
    if (PyErr_Occurred()) return NULL;
    if (code < 0 || code > 255 || bits <= 0 || bits > 255 || bits % 8) {
        PyErr_Format(PyExc_ValueError, "bad DLPack dtype (code %ld, bits %ld)", code, bits);
        return NULL;
    }
    int64_t shape[MAX_DIMS], stride[MAX_DIMS];
    int nd = read_dims(args[4], shape, "shape");
    if (nd < 0) return NULL;
    int ns = read_dims(args[5], stride, "stride");
    if (ns < 0) return NULL;
    if (ns != nd) {
        PyErr_Format(PyExc_ValueError, "shape has %d dimensions, stride %d", nd, ns);
        return NULL;
    }
    /* bytes the view spans (accel_graph.backends.recorder.pool._storage_bytes); the block is
     * at least one byte, as EnginePool has always asked */
    int64_t itemsize = bits / 8, span = 1;
    for (int i = 0; i < nd; i++) {
        if (shape[i] == 0) {
            span = 0;
            break;
        }
        if (stride[i] && shape[i] - 1 > (INT64_MAX / 2 - span) / stride[i]) {
            PyErr_SetString(PyExc_OverflowError, "tensor too large");
            return NULL;
        }
        span += (shape[i] - 1) * stride[i];
    }
    if (span > INT64_MAX / 2 / itemsize) {
        PyErr_SetString(PyExc_OverflowError, "tensor too large");
        return NULL;
    }
    int64_t nbytes = span * itemsize;
    holder *h = malloc(sizeof *h + 2 * (size_t)(nd ? nd : 1) * sizeof(int64_t));
    if (!h) return PyErr_NoMemory();
    int64_t addr = core_alloc(engine, nbytes > 0 ? nbytes : 1);
    if (addr < 0) {
        free(h);
        return PyLong_FromLongLong(addr);
    }
    h->engine = engine;
    h->owner = args[6] == Py_None ? NULL : args[6];
    Py_XINCREF(h->owner);
    h->key = (int64_t)key;
    for (int i = 0; i < nd; i++) {
        h->dims[i] = shape[i];
        h->dims[nd + i] = stride[i];
    }
    DLTensor *t = &h->m.dl_tensor;
    t->data = (void *)(uintptr_t)addr;
    t->device.device_type = kDLCPU;
    t->device.device_id = 0;
    t->ndim = nd;
    t->dtype.code = (uint8_t)code;
    t->dtype.bits = (uint8_t)bits;
    t->dtype.lanes = 1;
    t->shape = h->dims;
    t->strides = h->dims + nd;
    t->byte_offset = 0;
    h->m.manager_ctx = NULL;
    h->m.deleter = deleter;
    PyObject *cap = PyCapsule_New(&h->m, "dltensor", capsule_destructor);
    if (!cap) {
        deleter(&h->m);
        return NULL;
    }
    PyObject *out = PyObject_CallFunctionObjArgs(importer, cap, NULL);
    Py_DECREF(cap); /* consumed: nothing; not consumed (error): frees the block */
    return out;
}

/* drain(engine_addr) -> list of the keys of tensors that died since the last drain */
static PyObject *drain(PyObject *self, PyObject *arg) {
    if (!core_drain) {
        PyErr_SetString(PyExc_RuntimeError, "_dlpack.bind() was not called");
        return NULL;
    }
    void *engine = PyLong_AsVoidPtr(arg);
    if (!engine) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "null engine");
        return NULL;
    }
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    int64_t buf[256], n;
    do {
        n = core_drain(engine, buf, 256);
        for (int64_t i = 0; i < n; i++) {
            PyObject *k = PyLong_FromLongLong(buf[i]);
            if (!k || PyList_Append(out, k)) {
                /* the keys drained so far are lost to the caller: its books keep stale entries
                 * (harmless: every later storage id match is checked) */
                Py_XDECREF(k);
                Py_DECREF(out);
                return NULL;
            }
            Py_DECREF(k);
        }
    } while (n == 256);
    return out;
}

static PyMethodDef methods[] = {
    {"bind", (PyCFunction)(void (*)(void))bind, METH_FASTCALL,
     "bind(alloc_addr, release_addr, drain_addr, importer): the engine's ag_tensor_alloc, "
     "ag_tensor_release, ag_tensor_drain and torch's DLPack importer"},
    {"make", (PyCFunction)(void (*)(void))make, METH_FASTCALL,
     "make(engine_addr, key, code, bits, shape, stride, owner) -> tensor over a new engine "
     "block (owner kept alive until it dies), or the engine's negative status"},
    {"drain", drain, METH_O, "drain(engine_addr) -> keys of the tensors that died since the last drain"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_dlpack", .m_doc = NULL, .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__dlpack(void) { return PyModule_Create(&module); }
