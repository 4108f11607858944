/* The fingerprint launch in C: a queued fingerprint (`Batch.take`) without a Python frame.

   What `Deferred.__call__` -> `Batch.take` -> `Batch._launch` -> `Item(...)` do for a CUDA tensor
   whose (shape, dtype, device) already has a launch entry, done here with the same objects: the
   entry looked up in the batch's dict, the slot laid out in the batch's buffer (its `used`, `cap`,
   `chunk` and `base`, read and written as Python attributes, so the Python path and this one share
   one state), the kernel launched with cuLaunchKernel on the current stream, the `Item` made and
   queued.  Everything else (a first tensor of a shape, a new buffer, a tensor the fused kernel
   does not take, a CPU tensor) is the Python path's: `Taker` calls it.  The kernel's parameters
   are laid out once per entry (`Launch`, from Triton's own signature of the compiled kernel:
   native.py); per launch only the tensor's and the slot's addresses change.  Built by
   triton.runtime.build (the compiler and cache Triton builds its own launchers with).  The GIL is
   held throughout: launches of one entry never interleave. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include "cuda.h"

typedef CUresult (*launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              unsigned, CUstream, void **, void **);
typedef CUresult (*ctx_fn)(CUcontext *);
typedef CUresult (*err_fn)(CUresult, const char **);
static launch_fn cu_launch = NULL;
static ctx_fn cu_ctx = NULL;
static err_fn cu_err = NULL;

#define MAXP 48

/* ------------------------------------------------------------------ Launch: one entry's kernel */
typedef struct {
    PyObject_HEAD
    CUfunction fn;
    unsigned grid, block, shmem;
    long long words, fbyte, tbyte;
    int nparams;
    void *params[MAXP];
    uint64_t store[MAXP];      /* one 8-byte slot per parameter (little-endian: a narrower int is its low bytes) */
} Launch;

/* Launch(function, grid, block, shmem, words, fbyte, tbyte, sizes, values): the kernel's parameters in
   order, each `sizes[i]` bytes wide holding `values[i]`; the first five are the tensor, the sign
   table, the float partials, the int partials and the token flags (the per-launch ones are set at each
   launch), the last two Triton's global and profile scratch (null). */
static int Launch_init(Launch *self, PyObject *args, PyObject *kw) {
    unsigned long long fn;
    PyObject *sizes, *values;
    if (!PyArg_ParseTuple(args, "KIIILLLOO", &fn, &self->grid, &self->block, &self->shmem, &self->words,
                          &self->fbyte, &self->tbyte, &sizes, &values))
        return -1;
    if (!PyList_Check(sizes) || !PyList_Check(values) || PyList_GET_SIZE(sizes) != PyList_GET_SIZE(values)) {
        PyErr_SetString(PyExc_TypeError, "sizes and values: two lists of one length");
        return -1;
    }
    Py_ssize_t n = PyList_GET_SIZE(sizes);
    if (n < 5 || n > MAXP) {
        PyErr_Format(PyExc_ValueError, "%zd kernel parameters (5..%d taken)", n, MAXP);
        return -1;
    }
    self->fn = (CUfunction)(uintptr_t)fn;
    self->nparams = (int)n;
    for (Py_ssize_t i = 0; i < n; i++) {
        long size = PyLong_AsLong(PyList_GET_ITEM(sizes, i));
        unsigned long long v = PyLong_AsUnsignedLongLongMask(PyList_GET_ITEM(values, i));
        if (PyErr_Occurred())
            return -1;
        if (size != 1 && size != 2 && size != 4 && size != 8) {
            PyErr_Format(PyExc_ValueError, "parameter %zd: %ld bytes", i, size);
            return -1;
        }
        self->store[i] = 0;
        memcpy(&self->store[i], &v, (size_t)size);
        self->params[i] = &self->store[i];
    }
    return 0;
}

static PyTypeObject LaunchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tpprobe_native.Launch",
    .tp_basicsize = sizeof(Launch),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Launch_init,
    .tp_doc = "One launch entry's kernel and its parameters, laid out once.",
};

static int launch_one(Launch *l, unsigned long long tensor, unsigned long long slot, unsigned long long stream) {
    CUcontext ctx = NULL;
    if (cu_ctx(&ctx) != CUDA_SUCCESS || ctx == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "no current CUDA context");
        return -1;
    }
    uint64_t f = slot + (uint64_t)l->fbyte, t = slot + (uint64_t)l->tbyte;
    l->store[0] = tensor;
    l->store[2] = f;
    l->store[3] = slot;
    l->store[4] = t;
    CUresult r = cu_launch(l->fn, l->grid, 1, 1, l->block, 1, 1, l->shmem, (CUstream)(uintptr_t)stream,
                           l->params, NULL);
    if (r != CUDA_SUCCESS) {
        const char *s = "unknown";
        if (cu_err)
            cu_err(r, &s);
        PyErr_Format(PyExc_RuntimeError, "fingerprint launch failed: %s", s);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------ interned names */
static PyObject *s_batch, *s_entries, *s_shape, *s_dtype, *s_get_device, *s_data_ptr, *s_is_contiguous,
    *s_is_cuda, *s_native, *s_used, *s_cap, *s_chunk, *s_base, *s_items, *s_later, *s_direct, *s_new_buffer,
    *s_device, *s_fp, *s_tag, *s_entry, *s_off, *s_tensor, *s_rows;

static int intern_all(void) {
#define I(v, s) if (!(v = PyUnicode_InternFromString(s))) return -1;
    I(s_batch, "batch") I(s_entries, "entries") I(s_shape, "shape") I(s_dtype, "dtype")
    I(s_get_device, "get_device") I(s_data_ptr, "data_ptr") I(s_is_contiguous, "is_contiguous")
    I(s_is_cuda, "is_cuda") I(s_native, "native") I(s_used, "used") I(s_cap, "cap") I(s_chunk, "chunk")
    I(s_base, "base") I(s_items, "items") I(s_later, "later") I(s_direct, "direct")
    I(s_new_buffer, "_new_buffer") I(s_device, "device") I(s_fp, "fp") I(s_tag, "tag") I(s_entry, "entry")
    I(s_off, "off") I(s_tensor, "tensor") I(s_rows, "rows")
#undef I
    return 0;
}

/* ------------------------------------------------------------------ Taker: a Deferred's fast call */
typedef struct {
    PyObject_HEAD
    PyObject *deferred;     /* the Deferred: its `batch` */
    PyObject *slow;         /* the Python path: slow(t, later) */
    PyObject *stream;       /* stream(device index) -> the current stream's handle */
    PyObject *item;         /* the Item class (Batch's) */
    unsigned long long taken;   /* launches and queued slots made here (tests read it) */
} Taker;

static void Taker_dealloc(Taker *self) {
    Py_XDECREF(self->deferred);
    Py_XDECREF(self->slow);
    Py_XDECREF(self->stream);
    Py_XDECREF(self->item);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Taker_init(Taker *self, PyObject *args, PyObject *kw) {
    PyObject *d, *slow, *stream, *item;
    if (!PyArg_ParseTuple(args, "OOOO", &d, &slow, &stream, &item))
        return -1;
    if (!PyType_Check(item)) {
        PyErr_SetString(PyExc_TypeError, "item: a class");
        return -1;
    }
    Py_INCREF(d); Py_INCREF(slow); Py_INCREF(stream); Py_INCREF(item);
    Py_XSETREF(self->deferred, d);
    Py_XSETREF(self->slow, slow);
    Py_XSETREF(self->stream, stream);
    Py_XSETREF(self->item, item);
    self->taken = 0;
    return 0;
}

static PyObject *call_slow(Taker *self, PyObject *t, int later) {
    return PyObject_CallFunctionObjArgs(self->slow, t, later ? Py_True : Py_False, NULL);
}

static long long get_ll(PyObject *o, PyObject *name, int *err) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (!v) { *err = 1; return 0; }
    long long r = PyLong_AsLongLong(v);
    Py_DECREF(v);
    if (r == -1 && PyErr_Occurred())
        *err = 1;
    return r;
}

static int set_ll(PyObject *o, PyObject *name, long long v) {
    PyObject *x = PyLong_FromLongLong(v);
    if (!x)
        return -1;
    int r = PyObject_SetAttr(o, name, x);
    Py_DECREF(x);
    return r;
}

/* the Item for a slot: Item(None, entry, chunk, off, t, None) without running its __init__ */
static PyObject *make_item(Taker *self, PyObject *entry, PyObject *chunk, long long off, PyObject *t) {
    PyTypeObject *tp = (PyTypeObject *)self->item;
    PyObject *empty = PyTuple_New(0);
    if (!empty)
        return NULL;
    PyObject *it = tp->tp_new(tp, empty, NULL);
    Py_DECREF(empty);
    if (!it)
        return NULL;
    PyObject *o = PyLong_FromLongLong(off);
    if (!o || PyObject_SetAttr(it, s_fp, Py_None) || PyObject_SetAttr(it, s_tag, Py_None)
        || PyObject_SetAttr(it, s_entry, entry) || PyObject_SetAttr(it, s_chunk, chunk)
        || PyObject_SetAttr(it, s_off, o) || PyObject_SetAttr(it, s_tensor, t)
        || PyObject_SetAttr(it, s_rows, Py_None)) {
        Py_XDECREF(o);
        Py_DECREF(it);
        return NULL;
    }
    Py_DECREF(o);
    return it;
}

/* the fast path; returns NULL with no error set when the Python path is to take t */
static PyObject *take(Taker *self, PyObject *t, int later) {
    PyObject *batch = NULL, *entries = NULL, *shape = NULL, *dtype = NULL, *dev = NULL, *key = NULL;
    PyObject *nat = NULL, *x = NULL, *chunk = NULL, *it = NULL, *lst = NULL, *res = NULL, *entry = NULL;
    int err = 0;
    x = PyObject_GetAttr(t, s_is_cuda);
    if (!x) goto fail;
    if (x != Py_True) goto out;                 /* a CPU tensor */
    Py_CLEAR(x);
    batch = PyObject_GetAttr(self->deferred, s_batch);
    if (!batch) goto fail;
    if (batch == Py_None || batch == Py_False) goto out;   /* not started, or no fused kernel */
    x = PyObject_GetAttr(batch, s_direct);
    if (!x) goto fail;
    if (x != Py_True) goto out;                 /* the launch through JITFunction.run */
    Py_CLEAR(x);
    entries = PyObject_GetAttr(batch, s_entries);
    if (!entries) goto fail;
    if (!(shape = PyObject_GetAttr(t, s_shape))) goto fail;
    if (!(dtype = PyObject_GetAttr(t, s_dtype))) goto fail;
    if (!(dev = PyObject_CallMethodNoArgs(t, s_get_device))) goto fail;
    if (!(key = PyTuple_Pack(3, shape, dtype, dev))) goto fail;
    entry = PyDict_GetItemWithError(entries, key);     /* borrowed, then held */
    if (!entry) {
        if (PyErr_Occurred()) goto fail;
        goto out;                               /* a first tensor of its shape */
    }
    Py_INCREF(entry);
    nat = PyObject_GetAttr(entry, s_native);
    if (!nat) goto fail;
    if (Py_TYPE(nat) != &LaunchType) goto out;  /* an entry the fused kernel does not take, or no Launch */
    Launch *l = (Launch *)nat;
    x = PyObject_CallMethodNoArgs(t, s_data_ptr);
    if (!x) goto fail;
    unsigned long long ptr = PyLong_AsUnsignedLongLong(x);
    Py_CLEAR(x);
    if (PyErr_Occurred()) goto fail;
    if (ptr % 16) goto out;                     /* not the fused kernel's: the Python path says why */
    x = PyObject_CallMethodNoArgs(t, s_is_contiguous);
    if (!x) goto fail;
    int contiguous = PyObject_IsTrue(x);
    Py_CLEAR(x);
    if (contiguous < 0) goto fail;
    if (!contiguous) goto out;
    CUcontext ctx = NULL;
    if (cu_ctx(&ctx) != CUDA_SUCCESS || ctx == NULL) goto out;    /* Triton's launcher makes one current */
    long long off = get_ll(batch, s_used, &err);
    long long cap = get_ll(batch, s_cap, &err);
    if (err) goto fail;
    if (off + l->words > cap) {
        PyObject *d = PyObject_GetAttr(t, s_device);
        if (!d) goto fail;
        PyObject *w = PyLong_FromLongLong(l->words);
        x = w ? PyObject_CallMethodObjArgs(batch, s_new_buffer, w, d, NULL) : NULL;
        Py_XDECREF(w);
        Py_DECREF(d);
        if (!x) goto fail;
        Py_CLEAR(x);
        off = 0;
    }
    if (set_ll(batch, s_used, off + l->words)) goto fail;
    if (!(chunk = PyObject_GetAttr(batch, s_chunk))) goto fail;
    if (!later) {
        long long base = get_ll(batch, s_base, &err);
        if (err) goto fail;
        x = PyObject_CallOneArg(self->stream, dev);
        if (!x) goto fail;
        unsigned long long stream = PyLong_AsUnsignedLongLong(x);
        Py_CLEAR(x);
        if (PyErr_Occurred()) goto fail;
        if (launch_one(l, ptr, (unsigned long long)base + (unsigned long long)off * 8ULL, stream)) goto fail;
    }
    it = make_item(self, entry, chunk, off, t);
    if (!it) goto fail;
    if (later) {
        if (!(lst = PyObject_GetAttr(batch, s_later))) goto fail;
        if (PyList_Append(lst, it)) goto fail;
        Py_CLEAR(lst);
    }
    if (!(lst = PyObject_GetAttr(batch, s_items))) goto fail;
    if (PyList_Append(lst, it)) goto fail;
    self->taken++;
    res = it;
    it = NULL;
    goto out;
fail:
    res = NULL;
    err = 1;
out:
    Py_XDECREF(batch); Py_XDECREF(entries); Py_XDECREF(shape); Py_XDECREF(dtype); Py_XDECREF(dev);
    Py_XDECREF(key); Py_XDECREF(entry); Py_XDECREF(nat); Py_XDECREF(x); Py_XDECREF(chunk); Py_XDECREF(it); Py_XDECREF(lst);
    if (res == NULL && !err && !PyErr_Occurred())
        return call_slow(self, t, later);
    return res;
}

static PyObject *Taker_call(Taker *self, PyObject *args, PyObject *kw) {
    PyObject *t;
    int later = 0;
    static char *names[] = {"t", "later", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|p", names, &t, &later))
        return NULL;
    return take(self, t, later);
}

static PyObject *Taker_later(Taker *self, PyObject *t) {
    return take(self, t, 1);
}

static PyObject *Taker_taken(Taker *self, void *closure) {
    return PyLong_FromUnsignedLongLong(self->taken);
}

static PyMethodDef Taker_methods[] = {
    {"later", (PyCFunction)Taker_later, METH_O, "As a call with later=True (Deferred.later)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Taker_getset[] = {
    {"taken", (getter)Taker_taken, NULL, "slots taken here, not by the Python path", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject TakerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tpprobe_native.Taker",
    .tp_basicsize = sizeof(Taker),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Taker_init,
    .tp_dealloc = (destructor)Taker_dealloc,
    .tp_call = (ternaryfunc)Taker_call,
    .tp_methods = Taker_methods,
    .tp_getset = Taker_getset,
    .tp_doc = "Taker(deferred, slow, stream, item): deferred(t) and deferred.later(t), launched from C.",
};

/* launch_later(items, bases, stream): the launches `take(later=True)` queued, in one loop; every item's
   entry has a Launch and no torch-side row flags (native.py checks); bases: each chunk's address */
static PyObject *launch_later(PyObject *mod, PyObject *args) {
    PyObject *items, *bases;
    unsigned long long stream;
    if (!PyArg_ParseTuple(args, "O!O!K", &PyList_Type, &items, &PyList_Type, &bases, &stream))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(items);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *it = PyList_GET_ITEM(items, i);
        int err = 0;
        PyObject *entry = PyObject_GetAttr(it, s_entry);
        if (!entry) return NULL;
        PyObject *nat = PyObject_GetAttr(entry, s_native);
        Py_DECREF(entry);
        if (!nat) return NULL;
        if (Py_TYPE(nat) != &LaunchType) {
            Py_DECREF(nat);
            PyErr_SetString(PyExc_TypeError, "an item without a Launch");
            return NULL;
        }
        long long chunk = get_ll(it, s_chunk, &err);
        long long off = get_ll(it, s_off, &err);
        PyObject *t = err ? NULL : PyObject_GetAttr(it, s_tensor);
        PyObject *p = t ? PyObject_CallMethodNoArgs(t, s_data_ptr) : NULL;
        Py_XDECREF(t);
        if (!p) { Py_DECREF(nat); return NULL; }
        unsigned long long ptr = PyLong_AsUnsignedLongLong(p);
        Py_DECREF(p);
        if (chunk < 0 || chunk >= PyList_GET_SIZE(bases)) {
            Py_DECREF(nat);
            PyErr_SetString(PyExc_IndexError, "an item's chunk has no base");
            return NULL;
        }
        unsigned long long base = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(bases, chunk));
        if (PyErr_Occurred()) { Py_DECREF(nat); return NULL; }
        int r = launch_one((Launch *)nat, ptr, base + (unsigned long long)off * 8ULL, stream);
        Py_DECREF(nat);
        if (r) return NULL;
    }
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ Door: ProcessGroup.allreduce's door in C

   capture/audit/doors.py's door with Audit.begin / Audit.end and the Tap's `_after_collective`, for
   the one case a decode forward issues: `allreduce([t], opts)` of one plain CUDA tensor while a Tap
   that armed its Audit (`Audit.native`, a tuple: ARM_* below) is the running thread's innermost.
   The record is the one the Python path makes, field by field; the Tap's attribution and keep are
   called as they are.  Anything else (no Audit, another form, a subclass, a CPU tensor, a wrapper's
   record open, observers) goes to the Python door unchanged. */
enum { ARM_ATTRIBUTE, ARM_KEEP, ARM_SUMMARIZE, ARM_PROGRESS, ARM_RECORDS, ARM_BEFORE, ARM_COPY, ARM_AIN, ARM_AOUT,
       ARM_RECORD, ARM_DTYPES, ARM_DTYPE_NAME, ARM_SUB_RANKS, ARM_EVENT, ARM_EVENT_RECORD, ARM_STREAM,
       ARM_OBSERVERS, ARM_N };

static PyObject *s_stack, *s_native_arm, *s_active_record, *s_reduceOp, *s_size, *s_wait, *s_enter, *s_exit,
    *s_issued, *s_events, *s_seq, *s_module, *s_source, *s_layer, *s_where, *s_dtype_f, *s_group_size, *s_op,
    *s_kind, *s_path, *s_via, *s_checked, *s_group, *s_group_ranks, *s_splits, *s_inp, *s_out, *s_inp_summary,
    *s_out_summary, *s_seconds, *s_t0, *s__out, *s_all_reduce, *s_c10d_allreduce;

static int intern_door(void) {
#define I(v, s) if (!(v = PyUnicode_InternFromString(s))) return -1;
    I(s_stack, "stack") I(s_native_arm, "native") I(s_active_record, "active_record") I(s_reduceOp, "reduceOp")
    I(s_size, "size") I(s_wait, "wait") I(s_enter, "__enter__") I(s_exit, "__exit__") I(s_issued, "issued")
    I(s_events, "events") I(s_seq, "seq") I(s_module, "module") I(s_source, "source") I(s_layer, "layer")
    I(s_where, "where") I(s_dtype_f, "dtype") I(s_group_size, "group_size") I(s_op, "op") I(s_kind, "kind")
    I(s_path, "path") I(s_via, "via") I(s_checked, "checked") I(s_group, "group") I(s_group_ranks, "group_ranks")
    I(s_splits, "splits") I(s_inp, "inp") I(s_out, "out") I(s_inp_summary, "inp_summary")
    I(s_out_summary, "out_summary") I(s_seconds, "seconds") I(s_t0, "t0") I(s__out, "_out")
    I(s_all_reduce, "all_reduce") I(s_c10d_allreduce, "c10d.allreduce_")
#undef I
    return 0;
}

typedef struct {
    PyObject_HEAD
    PyObject *raw;          /* ProcessGroup.allreduce as it was */
    PyObject *py_door;      /* the Python door (doors._door): every other case */
    PyObject *thread;       /* interceptor.THREAD (its .stack) */
    PyObject *tensor;       /* torch.Tensor */
    PyObject *guard;        /* torch._C._AutoDispatchBelowADInplaceOrView */
    PyObject *raw_stream;   /* torch._C._cuda_getCurrentRawStream */
    PyObject *streams;      /* raw stream handle -> the kept Stream object */
    PyObject *ranks;        /* ProcessGroup -> (size, sub_ranks) */
    unsigned long long fast;    /* collectives recorded here, not by the Python door (tests read it) */
} Door;

static void Door_dealloc(Door *self) {
    Py_XDECREF(self->raw); Py_XDECREF(self->py_door); Py_XDECREF(self->thread); Py_XDECREF(self->tensor);
    Py_XDECREF(self->guard); Py_XDECREF(self->raw_stream); Py_XDECREF(self->streams); Py_XDECREF(self->ranks);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Door_init(Door *self, PyObject *args, PyObject *kw) {
    PyObject *raw, *py_door, *thread, *tensor, *guard, *raw_stream;
    if (!PyArg_ParseTuple(args, "OOOOOO", &raw, &py_door, &thread, &tensor, &guard, &raw_stream))
        return -1;
    Py_INCREF(raw); Py_INCREF(py_door); Py_INCREF(thread); Py_INCREF(tensor); Py_INCREF(guard);
    Py_INCREF(raw_stream);
    Py_XSETREF(self->raw, raw); Py_XSETREF(self->py_door, py_door); Py_XSETREF(self->thread, thread);
    Py_XSETREF(self->tensor, tensor); Py_XSETREF(self->guard, guard); Py_XSETREF(self->raw_stream, raw_stream);
    Py_XSETREF(self->streams, PyDict_New());
    Py_XSETREF(self->ranks, PyDict_New());
    self->fast = 0;
    return (self->streams && self->ranks) ? 0 : -1;
}

static PyObject *Door_get(PyObject *self, PyObject *obj, PyObject *type) {
    if (obj == NULL || obj == Py_None) {
        Py_INCREF(self);
        return self;
    }
    return PyMethod_New(self, obj);
}

static double now_wall(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double now_perf(void) {           /* time.perf_counter on Linux */
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int set_f(PyObject *o, PyObject *name, double v) {
    PyObject *x = PyFloat_FromDouble(v);
    if (!x)
        return -1;
    int r = PyObject_SetAttr(o, name, x);
    Py_DECREF(x);
    return r;
}

/* summarize(t): the Taker's own path when it is one, else a call */
static PyObject *summarize(PyObject *fn, PyObject *t) {
    if (Py_TYPE(fn) == &TakerType)
        return take((Taker *)fn, t, 0);
    return PyObject_CallOneArg(fn, t);
}

/* the kept Stream of the current stream of device `dev` (core/cuda.current_stream, cached by handle) */
static PyObject *stream_of(Door *self, PyObject *arm, PyObject *dev) {
    PyObject *h = PyObject_CallOneArg(self->raw_stream, dev);
    if (!h)
        return NULL;
    PyObject *s = PyDict_GetItemWithError(self->streams, h);
    if (s) {
        Py_DECREF(h);
        Py_INCREF(s);
        return s;
    }
    if (PyErr_Occurred()) { Py_DECREF(h); return NULL; }
    s = PyObject_CallOneArg(PyTuple_GET_ITEM(arm, ARM_STREAM), dev);
    if (s && PyDict_SetItem(self->streams, h, s)) Py_CLEAR(s);
    Py_DECREF(h);
    return s;
}

static PyObject *group_ranks(Door *self, PyObject *arm, PyObject *pg, PyObject *size) {
    PyObject *hit = PyDict_GetItemWithError(self->ranks, pg);
    if (hit && PyTuple_Check(hit) && PyTuple_GET_SIZE(hit) == 2) {
        int eq = PyObject_RichCompareBool(PyTuple_GET_ITEM(hit, 0), size, Py_EQ);
        if (eq < 0) return NULL;
        if (eq) { PyObject *r = PyTuple_GET_ITEM(hit, 1); Py_INCREF(r); return r; }
    }
    if (PyErr_Occurred()) return NULL;
    PyObject *r = PyObject_CallFunctionObjArgs(PyTuple_GET_ITEM(arm, ARM_SUB_RANKS), pg, size, NULL);
    if (!r) return NULL;
    PyObject *v = PyTuple_Pack(2, size, r);
    if (!v || PyDict_SetItem(self->ranks, pg, v)) { Py_XDECREF(v); Py_DECREF(r); return NULL; }
    Py_DECREF(v);
    return r;
}

/* a new CollectiveRecord with every field set as CollectiveRecord(seq, module, source, layer, where, shape,
   dtype, group_size, op) sets it (its __init__ not run: the fields are set here, defaults included) */
static PyObject *new_record(PyObject *arm, PyObject *seq, PyObject *att, PyObject *t, PyObject *size,
                            PyObject *op, PyObject *ranks) {
    PyTypeObject *tp = (PyTypeObject *)PyTuple_GET_ITEM(arm, ARM_RECORD);
    PyObject *empty = PyTuple_New(0), *rec = NULL, *shape = NULL, *tshape = NULL, *dt = NULL, *dname = NULL,
             *via = NULL;
    if (!empty) return NULL;
    rec = tp->tp_new(tp, empty, NULL);
    Py_DECREF(empty);
    if (!rec) return NULL;
    if (!(tshape = PyObject_GetAttr(t, s_shape))) goto fail;
    if (!(shape = PySequence_Tuple(tshape))) goto fail;
    if (!(dt = PyObject_GetAttr(t, s_dtype))) goto fail;
    dname = PyDict_GetItemWithError(PyTuple_GET_ITEM(arm, ARM_DTYPES), dt);
    if (dname) Py_INCREF(dname);
    else if (PyErr_Occurred() || !(dname = PyObject_CallOneArg(PyTuple_GET_ITEM(arm, ARM_DTYPE_NAME), t))) goto fail;
    if (!(via = PyList_New(0))) goto fail;
    if (PyObject_SetAttr(rec, s_seq, seq) || PyObject_SetAttr(rec, s_module, PyTuple_GET_ITEM(att, 0))
        || PyObject_SetAttr(rec, s_source, PyTuple_GET_ITEM(att, 3)) || PyObject_SetAttr(rec, s_layer, PyTuple_GET_ITEM(att, 1))
        || PyObject_SetAttr(rec, s_where, PyTuple_GET_ITEM(att, 2)) || PyObject_SetAttr(rec, s_shape, shape)
        || PyObject_SetAttr(rec, s_dtype_f, dname) || PyObject_SetAttr(rec, s_group_size, size)
        || PyObject_SetAttr(rec, s_op, op) || PyObject_SetAttr(rec, s_kind, s_all_reduce)
        || PyObject_SetAttr(rec, s_path, s_c10d_allreduce) || PyObject_SetAttr(rec, s_via, via)
        || PyObject_SetAttr(rec, s_checked, Py_True) || PyObject_SetAttr(rec, s_group, Py_None)
        || PyObject_SetAttr(rec, s_group_ranks, ranks) || PyObject_SetAttr(rec, s_splits, Py_None)
        || PyObject_SetAttr(rec, s_inp, Py_None) || PyObject_SetAttr(rec, s_out, Py_None)
        || PyObject_SetAttr(rec, s_inp_summary, Py_None) || PyObject_SetAttr(rec, s_out_summary, Py_None)
        || set_f(rec, s_seconds, 0.0) || set_f(rec, s_t0, 0.0) || PyObject_SetAttr(rec, s__out, Py_None))
        goto fail;
    Py_DECREF(tshape); Py_DECREF(shape); Py_DECREF(dt); Py_DECREF(dname); Py_DECREF(via);
    return rec;
fail:
    Py_XDECREF(tshape); Py_XDECREF(shape); Py_XDECREF(dt); Py_XDECREF(dname); Py_XDECREF(via); Py_DECREF(rec);
    return NULL;
}

/* copy(name_of(seq), t, where) into rec.<field>: Audit.copy of a kept collective's tensor */
static int keep_copy(PyObject *arm, PyObject *rec, PyObject *field, int name_at, PyObject *seq, PyObject *t,
                     PyObject *where) {
    PyObject *name = PyObject_CallOneArg(PyTuple_GET_ITEM(arm, name_at), seq);
    if (!name) return -1;
    PyObject *c = PyObject_CallFunctionObjArgs(PyTuple_GET_ITEM(arm, ARM_COPY), name, t, where, NULL);
    Py_DECREF(name);
    if (!c) return -1;
    int r = PyObject_SetAttr(rec, field, c);
    Py_DECREF(c);
    return r;
}

static PyObject *Door_call(Door *self, PyObject *args, PyObject *kw) {
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    if (n < 1) {
        PyErr_SetString(PyExc_TypeError, "allreduce: no ProcessGroup");
        return NULL;
    }
    PyObject *pg = PyTuple_GET_ITEM(args, 0);     /* args: (pg, tensors, opts), as the bound method has them */
    PyObject *st = NULL, *a = NULL, *arm = NULL, *x = NULL, *t = NULL, *op = NULL, *size = NULL, *att = NULL;
    PyObject *seq = NULL, *ranks = NULL, *rec = NULL, *g = NULL, *work = NULL, *res = NULL, *dev = NULL;
    PyObject *where = NULL, *records, *progress, *keep;
    int kept = 0;
    /* ---- the fast path's conditions: else the Python door */
    if ((kw && PyDict_GET_SIZE(kw)) || n != 3) goto slow;
    st = PyObject_GetAttr(self->thread, s_stack);
    if (!st) { PyErr_Clear(); goto slow; }
    if (!PyList_Check(st) || PyList_GET_SIZE(st) == 0) goto slow;
    a = PyList_GET_ITEM(st, PyList_GET_SIZE(st) - 1);
    Py_INCREF(a);
    arm = PyObject_GetAttr(a, s_native_arm);
    if (!arm) { PyErr_Clear(); goto slow; }
    if (!PyTuple_Check(arm) || PyTuple_GET_SIZE(arm) != ARM_N) goto slow;
    x = PyTuple_GET_ITEM(args, 1);
    if (!PyList_CheckExact(x) || PyList_GET_SIZE(x) != 1) { x = NULL; goto slow; }
    t = PyList_GET_ITEM(x, 0);
    x = NULL;
    if ((PyObject *)Py_TYPE(t) != self->tensor) { t = NULL; goto slow; }
    Py_INCREF(t);
    if (!(x = PyObject_GetAttr(t, s_is_cuda))) goto fail;
    if (x != Py_True) goto slow;
    Py_CLEAR(x);
    if (!(x = PyObject_GetAttr(a, s_active_record))) goto fail;
    if (x != Py_None) goto slow;
    Py_CLEAR(x);
    if (PyObject_IsTrue(PyTuple_GET_ITEM(arm, ARM_OBSERVERS))) goto slow;
    /* ---- the door: the op as the record names it, the group's size */
    op = PyObject_GetAttr(PyTuple_GET_ITEM(args, 2), s_reduceOp);
    if (!op) {
        PyErr_Clear();
        op = PyTuple_GET_ITEM(args, 2);
        Py_INCREF(op);
    }
    if (!(size = PyObject_CallMethodNoArgs(pg, s_size))) goto fail;
    /* ---- Audit.begin */
    if (PyTuple_GET_ITEM(arm, ARM_BEFORE) != Py_None) {
        if (!(x = PyObject_CallOneArg(PyTuple_GET_ITEM(arm, ARM_BEFORE), t))) goto fail;
        Py_CLEAR(x);
    }
    if (!(att = PyObject_CallOneArg(PyTuple_GET_ITEM(arm, ARM_ATTRIBUTE), t))) goto fail;
    if (!PyTuple_Check(att) || PyTuple_GET_SIZE(att) != 4) {
        PyErr_SetString(PyExc_TypeError, "attribute(): not (module, layer, where, source)");
        goto fail;
    }
    where = PyTuple_GET_ITEM(att, 2);
    records = PyTuple_GET_ITEM(arm, ARM_RECORDS);
    progress = PyTuple_GET_ITEM(arm, ARM_PROGRESS);
    keep = PyTuple_GET_ITEM(arm, ARM_KEEP);
    if (!(seq = PyLong_FromSsize_t(PyList_GET_SIZE(records)))) goto fail;
    if (!(ranks = group_ranks(self, arm, pg, size))) goto fail;
    if (!(rec = new_record(arm, seq, att, t, size, op, ranks))) goto fail;
    if (!(x = PyObject_CallOneArg(keep, where))) goto fail;
    kept = PyObject_IsTrue(x);
    Py_CLEAR(x);
    if (kept < 0) goto fail;
    if (kept && keep_copy(arm, rec, s_inp, ARM_AIN, seq, t, where)) goto fail;
    if (PyTuple_GET_ITEM(arm, ARM_SUMMARIZE) != Py_None) {
        if (!(x = summarize(PyTuple_GET_ITEM(arm, ARM_SUMMARIZE), t))) goto fail;
        if (PyObject_SetAttr(rec, s_inp_summary, x)) goto fail;
        Py_CLEAR(x);
    }
    if (PyList_Append(records, rec)) goto fail;
    if (progress != Py_None) {
        PyObject *w = PyFloat_FromDouble(now_wall());
        x = w ? PyTuple_Pack(2, rec, w) : NULL;
        Py_XDECREF(w);
        if (!x || PyObject_SetAttr(progress, s_issued, x)) goto fail;
        Py_CLEAR(x);
    }
    double t0 = now_perf();
    if (set_f(rec, s_t0, t0)) goto fail;
    /* ---- the collective, below ADInplaceOrView (the audit's kernel not called), then its wait */
    if (!(g = PyObject_CallNoArgs(self->guard))) goto fail;
    if (!(x = PyObject_CallMethodNoArgs(g, s_enter))) goto fail;
    Py_CLEAR(x);
    work = PyObject_Call(self->raw, args, NULL);
    {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        x = PyObject_CallMethodObjArgs(g, s_exit, Py_None, Py_None, Py_None, NULL);
        if (!x) { Py_XDECREF(et); Py_XDECREF(ev); Py_XDECREF(tb); goto fail; }
        Py_CLEAR(x);
        PyErr_Restore(et, ev, tb);
    }
    if (!work) goto fail;
    if (work != Py_None) {
        if (!(x = PyObject_CallMethodNoArgs(work, s_wait))) goto fail;
        Py_CLEAR(x);
    }
    /* ---- Audit.end, with the Tap's _after_collective */
    if (set_f(rec, s_seconds, t0 ? now_perf() - t0 : 0.0)) goto fail;
    if (progress != Py_None && PyObject_SetAttr(progress, s_issued, Py_None)) goto fail;
    if (!(dev = PyObject_CallMethodNoArgs(t, s_get_device))) goto fail;
    {
        PyObject *strm = stream_of(self, arm, dev);
        if (!strm) goto fail;
        PyObject *ev = PyObject_CallNoArgs(PyTuple_GET_ITEM(arm, ARM_EVENT));
        if (!ev) { Py_DECREF(strm); goto fail; }
        x = PyObject_CallFunctionObjArgs(PyTuple_GET_ITEM(arm, ARM_EVENT_RECORD), ev, strm, NULL);
        Py_DECREF(strm);
        if (!x) { Py_DECREF(ev); goto fail; }
        Py_CLEAR(x);
        PyObject *events = progress != Py_None ? PyObject_GetAttr(progress, s_events) : NULL;
        if (!events) { Py_DECREF(ev); goto fail; }
        PyObject *pair = PyTuple_Pack(2, seq, ev);
        Py_DECREF(ev);
        int r = pair ? PyList_Append(events, pair) : -1;
        Py_XDECREF(pair);
        Py_DECREF(events);
        if (r) goto fail;
    }
    if (kept) {
        if (!(x = PyObject_GetAttr(rec, s_inp))) goto fail;
        int has = x != Py_None;
        Py_CLEAR(x);
        if (has) {
            if (!(x = PyObject_CallOneArg(keep, where))) goto fail;
            int k = PyObject_IsTrue(x);
            Py_CLEAR(x);
            if (k < 0) goto fail;
            if (k) {
                if (keep_copy(arm, rec, s_out, ARM_AOUT, seq, t, where)) goto fail;
                if (!(x = PyObject_GetAttr(rec, s_out))) goto fail;
                if (x == Py_None && PyObject_SetAttr(rec, s_inp, Py_None)) goto fail;   /* both or neither */
                Py_CLEAR(x);
            }
        }
    }
    if (PyTuple_GET_ITEM(arm, ARM_SUMMARIZE) != Py_None) {
        if (!(x = summarize(PyTuple_GET_ITEM(arm, ARM_SUMMARIZE), t))) goto fail;
        if (PyObject_SetAttr(rec, s_out_summary, x)) goto fail;
        Py_CLEAR(x);
    }
    self->fast++;
    res = work;
    work = NULL;
    goto done;
slow:
    res = PyObject_Call(self->py_door, args, kw);
    goto done;
fail:
    res = NULL;
done:
    Py_XDECREF(st); Py_XDECREF(a); Py_XDECREF(arm); Py_XDECREF(x); Py_XDECREF(t);
    Py_XDECREF(op); Py_XDECREF(size); Py_XDECREF(att); Py_XDECREF(seq); Py_XDECREF(ranks); Py_XDECREF(rec);
    Py_XDECREF(g); Py_XDECREF(work); Py_XDECREF(dev);
    return res;
}

static PyObject *Door_wrapped(Door *self, void *c) { Py_INCREF(self->raw); return self->raw; }
static PyObject *Door_true(Door *self, void *c) { Py_RETURN_TRUE; }
static PyObject *Door_fast(Door *self, void *c) { return PyLong_FromUnsignedLongLong(self->fast); }

static PyGetSetDef Door_getset[] = {
    {"__wrapped__", (getter)Door_wrapped, NULL, "ProcessGroup.allreduce as it was", NULL},
    {"_tpprobe_door", (getter)Door_true, NULL, "tpprobe's door (doors.Doors.close puts the method back)", NULL},
    {"fast", (getter)Door_fast, NULL, "collectives recorded here, not by the Python door", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject DoorType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tpprobe_native.Door",
    .tp_basicsize = sizeof(Door),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Door_init,
    .tp_dealloc = (destructor)Door_dealloc,
    .tp_call = (ternaryfunc)Door_call,
    .tp_descr_get = Door_get,
    .tp_getset = Door_getset,
    .tp_doc = "Door(raw, py_door, thread, tensor, guard, raw_stream): ProcessGroup.allreduce's door in C.",
};

static PyMethodDef module_methods[] = {
    {"launch_later", launch_later, METH_VARARGS, "launch_later(items, bases, stream)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "tpprobe_native", NULL, -1, module_methods};

PyMODINIT_FUNC PyInit_tpprobe_native(void) {
    void *h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (!h) {
        PyErr_SetString(PyExc_ImportError, "libcuda.so.1 does not open");
        return NULL;
    }
    cu_launch = (launch_fn)dlsym(h, "cuLaunchKernel");
    cu_ctx = (ctx_fn)dlsym(h, "cuCtxGetCurrent");
    cu_err = (err_fn)dlsym(h, "cuGetErrorString");
    if (!cu_launch || !cu_ctx) {
        PyErr_SetString(PyExc_ImportError, "libcuda.so.1 has no cuLaunchKernel / cuCtxGetCurrent");
        return NULL;
    }
    if (intern_all() || intern_door() || PyType_Ready(&LaunchType) < 0 || PyType_Ready(&TakerType) < 0
        || PyType_Ready(&DoorType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&LaunchType);
    Py_INCREF(&TakerType);
    Py_INCREF(&DoorType);
    if (PyModule_AddObject(m, "Launch", (PyObject *)&LaunchType) < 0
        || PyModule_AddObject(m, "Taker", (PyObject *)&TakerType) < 0
        || PyModule_AddObject(m, "Door", (PyObject *)&DoorType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
