/* vattn._C: virtual-memory primitives for the vattn KV cache.
 *
 * Host (Linux):  reserve address space (mmap PROT_NONE | MAP_NORESERVE), map pages of a
 *                memfd (created in Python) with MAP_FIXED | MAP_SHARED, unmap by
 *                re-reserving the range. Every mapping is MADV_DONTFORK: a forked child
 *                (DataLoader workers, multiprocessing) never sees the cache's pages.
 * CUDA:          the driver's VMM calls, resolved at run time with dlopen of libcuda.so.1
 *                (or of a path the caller gives: the tests' fake driver), so this file
 *                builds and imports on machines with no CUDA at all. Each `cuda_load()`
 *                returns a CudaDriver object that carries its own function table.
 * Both:          batched map/unmap of page groups (one page of one slot in all buffers)
 *                with the GIL released, and DLPack export of a reserved range.
 *
 * A batched map is atomic: if any page fails, every page this call mapped is
 * unmapped again before the error is raised, so the caller's books never lie.
 *
 * Contexts: every CUDA call runs in the device's primary context (the one PyTorch uses),
 * made current on the calling thread for the call only; the caller's context is current
 * again afterwards, so torch.cuda.current_device() never changes under the caller.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "dlpack.h"

/* "O&" converter: a Python int in [0, 2**64), with OverflowError otherwise ("K" would wrap). */
static int to_u64(PyObject *o, void *out) {
  unsigned long long v = PyLong_AsUnsignedLongLong(o);
  if (v == (unsigned long long)-1 && PyErr_Occurred()) return 0;
  *(unsigned long long *)out = v;
  return 1;
}

/* ------------------------------------------------------------------------- */
/* CUDA driver types and the table of one loaded driver                       */
/* ------------------------------------------------------------------------- */

/* ABI-stable parts of cuda.h, declared here so no toolkit is needed. */
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemHandle;
typedef struct CUctx_st *CUcontext;
typedef struct { int type; int id; } CUmemLocation;
typedef struct {
  int type;                 /* CU_MEM_ALLOCATION_TYPE_PINNED = 1 */
  int requestedHandleTypes; /* CU_MEM_HANDLE_TYPE_NONE = 0 */
  CUmemLocation location;   /* CU_MEM_LOCATION_TYPE_DEVICE = 1 */
  void *win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
} CUmemAllocationProp;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;

#if PY_VERSION_HEX < 0x030D0000
#define Py_IsFinalizing _Py_IsFinalizing
#endif

enum { CUDA_ERROR_DEINITIALIZED = 4, CUDA_ERROR_INVALID_DEVICE = 101 };

#define MAX_DEVICES 64

typedef struct {
  PyObject_HEAD
  void *lib;
  PyObject *path; /* str: what was dlopen()ed */
  CUresult (*Init)(unsigned int);
  CUresult (*DeviceGet)(CUdevice *, int);
  CUresult (*DevicePrimaryCtxRetain)(CUcontext *, CUdevice);
  CUresult (*CtxGetCurrent)(CUcontext *);
  CUresult (*CtxSetCurrent)(CUcontext);
  CUresult (*GetErrorName)(CUresult, const char **);
  CUresult (*MemGetAllocationGranularity)(size_t *, const CUmemAllocationProp *, int);
  CUresult (*MemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*MemAddressFree)(CUdeviceptr, size_t);
  CUresult (*MemCreate)(CUmemHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
  CUresult (*MemRelease)(CUmemHandle);
  CUresult (*MemMap)(CUdeviceptr, size_t, size_t, CUmemHandle, unsigned long long);
  CUresult (*MemUnmap)(CUdeviceptr, size_t);
  CUresult (*MemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
  CUcontext primary_ctx[MAX_DEVICES]; /* retained once, kept for the life of the object */
} DriverObject;

static PyObject *DriverError; /* args: (call, code, name) */

static const char *error_name(DriverObject *d, CUresult rc) {
  const char *name = NULL;
  if (d->GetErrorName(rc, &name) || !name) name = "CUDA_ERROR_UNKNOWN";
  return name;
}

static PyObject *raise_driver(DriverObject *d, const char *call, CUresult rc) {
  PyObject *args = Py_BuildValue("(sis)", call, (int)rc, error_name(d, rc));
  if (args) {
    PyErr_SetObject(DriverError, args);
    Py_DECREF(args);
  }
  return NULL;
}

/* The device's primary context current on this thread for one call; ctx_leave puts the
 * caller's context (another device's, or none) back. Called with the GIL held. */
typedef struct {
  CUcontext prev;
  int switched;
} CtxScope;

static CUresult ctx_enter(DriverObject *d, int dev, CtxScope *s, const char **call) {
  s->prev = NULL;
  s->switched = 0;
  if (dev < 0 || dev >= MAX_DEVICES) {
    *call = "cuDeviceGet";
    return CUDA_ERROR_INVALID_DEVICE;
  }
  CUresult rc;
  if (!d->primary_ctx[dev]) {
    CUdevice cd;
    if ((rc = d->DeviceGet(&cd, dev))) { *call = "cuDeviceGet"; return rc; }
    if ((rc = d->DevicePrimaryCtxRetain(&d->primary_ctx[dev], cd))) { *call = "cuDevicePrimaryCtxRetain"; return rc; }
  }
  if ((rc = d->CtxGetCurrent(&s->prev))) { *call = "cuCtxGetCurrent"; return rc; }
  if (s->prev != d->primary_ctx[dev]) {
    if ((rc = d->CtxSetCurrent(d->primary_ctx[dev]))) { *call = "cuCtxSetCurrent"; return rc; }
    s->switched = 1;
  }
  return 0;
}

/* Never fails the call: the work is done (or undone) by now, and the books follow it. */
static void ctx_leave(DriverObject *d, CtxScope *s) {
  if (s->switched) d->CtxSetCurrent(s->prev);
}

/* ------------------------------------------------------------------------- */
/* Range: a reserved virtual address range, kept alive by exported tensors.   */
/* ------------------------------------------------------------------------- */

enum { KIND_HOST = 0, KIND_CUDA = 1 };

typedef struct {
  PyObject_HEAD
  uint64_t addr;
  uint64_t size;
  int kind;
  int device_id;
  DriverObject *driver; /* CUDA: the driver that reserved it (kept loaded while the range lives) */
  PyObject *keepalive;  /* released first in dealloc, while the range is still reserved */
} RangeObject;

static int Range_traverse(RangeObject *self, visitproc visit, void *arg) {
  Py_VISIT(self->keepalive);
  return 0;
}

static int Range_clear(RangeObject *self) {
  Py_CLEAR(self->keepalive);
  return 0;
}

/* cuMemAddressFree in the device's context. If the driver refuses (pages still mapped: an
 * owner that never unmapped them), the address space leaks with a warning; it is never
 * handed back with pages behind it. Called with the GIL held and no exception pending. */
static void range_free_cuda(RangeObject *self) {
  DriverObject *d = self->driver;
  CtxScope scope;
  const char *call = "cuMemAddressFree";
  CUresult rc = ctx_enter(d, self->device_id, &scope, &call);
  if (!rc) {
    rc = d->MemAddressFree((CUdeviceptr)self->addr, self->size);
    ctx_leave(d, &scope);
  }
  if (rc && rc != CUDA_ERROR_DEINITIALIZED && !Py_IsFinalizing()) { /* at exit the driver frees it all */
    if (PyErr_WarnFormat(PyExc_RuntimeWarning, 1,
                         "vattn: %s failed with %s (%d) for a CUDA range of %llu bytes at %p; its address "
                         "space leaks (were pages still mapped in it?)",
                         call, error_name(d, rc), (int)rc, (unsigned long long)self->size,
                         (void *)(uintptr_t)self->addr) < 0)
      PyErr_WriteUnraisable(NULL); /* warnings are errors: report it, never raise from a dealloc */
  }
}

static void Range_dealloc(RangeObject *self) {
  PyObject_GC_UnTrack(self);
  /* The owner goes first: its finalizer may unmap pages of this range, which is still
   * reserved. It may run Python code, so keep any exception that is being raised. */
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  Py_CLEAR(self->keepalive);
  if (self->size) {
    if (self->kind == KIND_HOST) munmap((void *)(uintptr_t)self->addr, self->size);
    else if (self->driver) range_free_cuda(self);
  }
  Py_CLEAR(self->driver);
  PyErr_Restore(type, value, tb);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

/* ------------------------------------------------------------------------- */
/* DLPack export                                                              */
/* ------------------------------------------------------------------------- */

typedef struct {
  DLManagedTensor managed;
  PyObject *owner; /* the reservation: the address space lives as long as any tensor */
  int64_t dims[16];
} Export;

/* Torch calls this when the last view dies, on any thread and maybe while an exception
 * is being raised (a tensor freed during unwinding): keep that exception. */
static void export_deleter(DLManagedTensor *m) {
  Export *e = (Export *)m->manager_ctx;
  PyGILState_STATE g = PyGILState_Ensure();
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  Py_XDECREF(e->owner);
  PyErr_Restore(type, value, tb);
  PyGILState_Release(g);
  PyMem_RawFree(e);
}

static void capsule_destructor(PyObject *cap) {
  /* A consumer renames the capsule to "used_dltensor"; only an unused one is ours to free. */
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb); /* keep any pending exception */
  if (PyCapsule_IsValid(cap, "dltensor")) {
    DLManagedTensor *m = (DLManagedTensor *)PyCapsule_GetPointer(cap, "dltensor");
    if (m && m->deleter) m->deleter(m);
  }
  PyErr_Restore(type, value, tb);
}

static int read_i64_tuple(PyObject *seq, int64_t *out, int max, const char *what) {
  PyObject *fast = PySequence_Fast(seq, what);
  if (!fast) return -1;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  if (n > max) {
    Py_DECREF(fast);
    PyErr_Format(PyExc_ValueError, "%s: at most %d dimensions", what, max);
    return -1;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
    if (v == -1 && PyErr_Occurred()) {
      Py_DECREF(fast);
      return -1;
    }
    out[i] = v;
  }
  Py_DECREF(fast);
  return (int)n;
}

/* A "dltensor" capsule viewing base + offset of [base, base + size), owned by `owner`.
 * Strides in elements. The view must lie inside the range. */
static PyObject *export_view(PyObject *owner, uint64_t base, uint64_t size, uint64_t offset, PyObject *shape_obj,
                             PyObject *strides_obj, int code, int bits, int device_type, int device_id) {
  if (!size) {
    PyErr_SetString(PyExc_ValueError, "range was released");
    return NULL;
  }
  Export *e = PyMem_RawCalloc(1, sizeof(Export));
  if (!e) return PyErr_NoMemory();
  int nd = read_i64_tuple(shape_obj, e->dims, 8, "shape");
  int ns = nd < 0 ? -1 : read_i64_tuple(strides_obj, e->dims + 8, 8, "strides");
  if (nd < 0 || ns < 0 || nd != ns || bits <= 0 || bits % 8) {
    PyMem_RawFree(e);
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "shape and strides must have the same length; bits a multiple of 8");
    return NULL;
  }
  /* Bounds check: the highest byte the view can touch must be inside the range (no wrap). */
  uint64_t last = 0, term, end;
  int overflow = 0;
  for (int i = 0; i < nd; i++) {
    if (e->dims[i] < 0 || e->dims[8 + i] < 0) {
      PyMem_RawFree(e);
      PyErr_SetString(PyExc_ValueError, "negative shape or stride");
      return NULL;
    }
    if (e->dims[i] == 0) { last = 0; break; }
    overflow |= __builtin_mul_overflow((uint64_t)(e->dims[i] - 1), (uint64_t)e->dims[8 + i], &term);
    overflow |= __builtin_add_overflow(last, term, &last);
  }
  overflow |= __builtin_add_overflow(last, 1, &end);
  overflow |= __builtin_mul_overflow(end, (uint64_t)(bits / 8), &end);
  overflow |= __builtin_add_overflow(end, offset, &end);
  if (overflow || end > size) {
    PyMem_RawFree(e);
    PyErr_SetString(PyExc_ValueError, "view extends past the end of the reserved range");
    return NULL;
  }
  DLTensor *t = &e->managed.dl_tensor;
  t->data = (void *)(uintptr_t)(base + offset);
  t->device.device_type = device_type;
  t->device.device_id = device_id;
  t->ndim = nd;
  t->dtype.code = (uint8_t)code;
  t->dtype.bits = (uint8_t)bits;
  t->dtype.lanes = 1;
  t->shape = e->dims;
  t->strides = e->dims + 8;
  t->byte_offset = 0;
  e->managed.manager_ctx = e;
  e->managed.deleter = export_deleter;
  Py_INCREF(owner);
  e->owner = owner;
  PyObject *cap = PyCapsule_New(&e->managed, "dltensor", capsule_destructor);
  if (!cap) export_deleter(&e->managed);
  return cap;
}

/* Range.dlpack(offset, shape, strides, code, bits) -> "dltensor" capsule on the range's device. */
static PyObject *Range_dlpack(RangeObject *self, PyObject *args) {
  unsigned long long offset;
  PyObject *shape_obj, *strides_obj;
  int code, bits;
  if (!PyArg_ParseTuple(args, "O&OOii", to_u64, &offset, &shape_obj, &strides_obj, &code, &bits)) return NULL;
  int host = self->kind == KIND_HOST;
  return export_view((PyObject *)self, self->addr, self->size, offset, shape_obj, strides_obj, code, bits,
                     host ? kDLCPU : kDLCUDA, host ? 0 : self->device_id);
}

/* dlpack(owner, offset, shape, strides, code, bits, device_type, device_id) -> "dltensor" capsule
 * viewing owner.addr + offset on the given device, for any owner with .addr and .size. */
static PyObject *dlpack_export(PyObject *m, PyObject *args) {
  PyObject *owner, *shape_obj, *strides_obj;
  unsigned long long offset, base, size;
  int code, bits, device_type, device_id;
  if (!PyArg_ParseTuple(args, "OO&OOiiii", &owner, to_u64, &offset, &shape_obj, &strides_obj, &code, &bits,
                        &device_type, &device_id))
    return NULL;
  PyObject *a = PyObject_GetAttrString(owner, "addr");
  int ok = a && to_u64(a, &base);
  Py_XDECREF(a);
  if (!ok) return NULL;
  PyObject *s = PyObject_GetAttrString(owner, "size");
  ok = s && to_u64(s, &size);
  Py_XDECREF(s);
  if (!ok) return NULL;
  return export_view(owner, base, size, offset, shape_obj, strides_obj, code, bits, device_type, device_id);
}

static PyMethodDef Range_methods[] = {
    {"dlpack", (PyCFunction)Range_dlpack, METH_VARARGS,
     "dlpack(offset, shape, strides, code, bits) -> DLPack capsule viewing the range (no copy)."},
    {NULL}};

static PyObject *Range_get_addr(RangeObject *s, void *c) { return PyLong_FromUnsignedLongLong(s->addr); }
static PyObject *Range_get_size(RangeObject *s, void *c) { return PyLong_FromUnsignedLongLong(s->size); }
static PyObject *Range_get_keepalive(RangeObject *s, void *c) {
  PyObject *v = s->keepalive ? s->keepalive : Py_None;
  Py_INCREF(v);
  return v;
}
static int Range_set_keepalive(RangeObject *s, PyObject *v, void *c) {
  PyObject *old = s->keepalive;
  s->keepalive = (v == NULL || v == Py_None) ? NULL : v; /* `del r.keepalive` means None */
  Py_XINCREF(s->keepalive);
  Py_XDECREF(old);
  return 0;
}
static PyGetSetDef Range_getset[] = {
    {"addr", (getter)Range_get_addr, NULL, "first byte of the range", NULL},
    {"size", (getter)Range_get_size, NULL, "length in bytes", NULL},
    {"keepalive", (getter)Range_get_keepalive, (setter)Range_set_keepalive,
     "one object the range keeps alive (None by default), released before the range is freed: "
     "an owner whose finalizer unmaps the range's pages runs while the range is still reserved. "
     "Cycles through it are collected by the garbage collector.",
     NULL},
    {NULL}};

static PyTypeObject RangeType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "vattn._C.Range",
    .tp_basicsize = sizeof(RangeObject),
    .tp_dealloc = (destructor)Range_dealloc,
    .tp_traverse = (traverseproc)Range_traverse,
    .tp_clear = (inquiry)Range_clear,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A reserved virtual address range; freed when the last reference (tensors included) goes.",
    .tp_methods = Range_methods,
    .tp_getset = Range_getset,
};

static PyObject *new_range(uint64_t addr, uint64_t size, int kind, int device_id, DriverObject *driver) {
  RangeObject *r = PyObject_GC_New(RangeObject, &RangeType);
  if (!r) return NULL;
  r->addr = addr;
  r->size = size;
  r->kind = kind;
  r->device_id = device_id;
  Py_XINCREF(driver);
  r->driver = driver;
  r->keepalive = NULL;
  PyObject_GC_Track(r);
  return (PyObject *)r;
}

/* ------------------------------------------------------------------------- */
/* Buffers passed from Python: array('Q') / array('i') or anything with the   */
/* buffer protocol.                                                           */
/* ------------------------------------------------------------------------- */

/* End (exclusive) of the run of contiguous page offsets that starts at i. */
static Py_ssize_t run_end(const uint64_t *offs, Py_ssize_t i, Py_ssize_t n, uint64_t page) {
  Py_ssize_t j = i + 1;
  while (j < n && offs[j] == offs[j - 1] + page) j++;
  return j;
}

static int get_u64s(Py_buffer *b, Py_ssize_t *n, const char *what) {
  if (b->itemsize != 8) {
    PyErr_Format(PyExc_TypeError, "%s: expected 8-byte items", what);
    return -1;
  }
  *n = b->len / 8;
  return 0;
}

/* ------------------------------------------------------------------------- */
/* Host backend                                                               */
/* ------------------------------------------------------------------------- */

#ifndef MAP_FIXED_NOREPLACE
#define MAP_FIXED_NOREPLACE 0x100000
#endif

/* Keep a new mapping out of forked children (a fresh mmap does not inherit the flag). */
static int dontfork(void *p, uint64_t len) { return madvise(p, len, MADV_DONTFORK) ? errno : 0; }

static int host_rereserve(uint64_t addr, uint64_t len) {
  void *want = (void *)(uintptr_t)addr;
  void *p = mmap(want, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  if (p != MAP_FAILED) return dontfork(p, len);
  if (errno != ENOMEM) return errno;
  /* At vm.max_map_count the in-place replacement can fail; munmap (which frees the
   * mapping's VMA) then reserve the hole again. NOREPLACE: never clobber a mapping that
   * another thread placed in the hole meanwhile. */
  if (munmap(want, len) != 0) return errno;
  p = mmap(want, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
  if (p == MAP_FAILED) return errno;
  if (p != want) {
    munmap(p, len);
    return EEXIST;
  }
  return dontfork(p, len);
}

static PyObject *host_reserve(PyObject *m, PyObject *args) {
  unsigned long long size;
  if (!PyArg_ParseTuple(args, "O&", to_u64, &size)) return NULL;
  if (size == 0) {
    PyErr_SetString(PyExc_ValueError, "size must be > 0");
    return NULL;
  }
  void *p = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return PyErr_SetFromErrno(PyExc_OSError);
  int e = dontfork(p, size);
  if (e) {
    munmap(p, size);
    errno = e;
    return PyErr_SetFromErrno(PyExc_OSError);
  }
  PyObject *r = new_range((uint64_t)(uintptr_t)p, size, KIND_HOST, 0, NULL);
  if (!r) munmap(p, size);
  return r;
}

/* The host calls below let go of the GIL only for batches of more than GIL_HOLD_CALLS system
 * calls. One mmap takes microseconds; a thread that lets go of the GIL for it must then win it
 * back from whichever thread took it meanwhile, which waits up to the interpreter's switch
 * interval (5 ms) when that thread runs Python (a server's event loop streaming answers while
 * its batching thread maps a prefill's pages). benchmarks/gil_wait.py measures it. Large
 * batches (a page group of a many-layer model, a scratch backing at start-up) still run
 * without it. */
#define GIL_HOLD_CALLS 64
static PyThreadState *maybe_release(Py_ssize_t calls) { return calls > GIL_HOLD_CALLS ? PyEval_SaveThread() : NULL; }
static void reacquire(PyThreadState *ts) {
  if (ts) PyEval_RestoreThread(ts);
}

/* host_map(bases, offsets, fds, file_offsets, file_strides, page_size)
 * Group i goes to bases[b] + offsets[i] in every buffer b, backed by
 * fds[i] at file_offsets[i] + b * file_strides[i]. Runs that are contiguous in
 * both the address space and the file are mapped with one mmap. Atomic. */
static PyObject *host_map(PyObject *m, PyObject *args) {
  Py_buffer bb, ob, fb, fob, fsb;
  unsigned long long page;
  if (!PyArg_ParseTuple(args, "y*y*y*y*y*O&", &bb, &ob, &fb, &fob, &fsb, to_u64, &page)) return NULL;
  PyObject *ret = NULL;
  Py_ssize_t nb, n, nfo, nfs;
  if (get_u64s(&bb, &nb, "bases") || get_u64s(&ob, &n, "offsets") || get_u64s(&fob, &nfo, "file_offsets") ||
      get_u64s(&fsb, &nfs, "file_strides"))
    goto out;
  if (fb.itemsize != 4 || fb.len / 4 != n || nfo != n || nfs != n || page == 0) {
    PyErr_SetString(PyExc_ValueError, "host_map: fds (int32), offsets, file_offsets and file_strides must match");
    goto out;
  }
  const uint64_t *bases = bb.buf, *offs = ob.buf, *foffs = fob.buf, *fstr = fsb.buf;
  const int32_t *fds = fb.buf;
  int err = 0;
  Py_ssize_t done_b = 0; /* the buffer that failed, for the undo */
  PyThreadState *ts = maybe_release(nb * n);
  for (Py_ssize_t b = 0; b < nb && !err; b++) {
    Py_ssize_t i = 0;
    while (i < n) {
      Py_ssize_t j = i + 1;
      while (j < n && fds[j] == fds[i] && offs[j] == offs[j - 1] + page &&
             foffs[j] + b * fstr[j] == foffs[j - 1] + b * fstr[j - 1] + page)
        j++;
      void *p = mmap((void *)(uintptr_t)(bases[b] + offs[i]), (j - i) * page, PROT_READ | PROT_WRITE,
                     MAP_SHARED | MAP_FIXED, fds[i], (off_t)(foffs[i] + b * fstr[i]));
      if (p == MAP_FAILED || (err = dontfork(p, (j - i) * page))) {
        if (p == MAP_FAILED) err = errno;
        done_b = b;
        break;
      }
      i = j;
    }
  }
  if (err) { /* undo: every target of buffers <= done_b (a failed MAP_FIXED may have dropped the old
                 PROT_NONE reservation too; re-reserving an untouched range is harmless) */
    for (Py_ssize_t b = 0; b <= done_b; b++)
      for (Py_ssize_t i = 0; i < n; i++) host_rereserve(bases[b] + offs[i], page);
  }
  reacquire(ts);
  if (err) {
    errno = err;
    PyErr_SetFromErrno(PyExc_OSError);
    goto out;
  }
  ret = Py_None;
  Py_INCREF(ret);
out:
  PyBuffer_Release(&bb);
  PyBuffer_Release(&ob);
  PyBuffer_Release(&fb);
  PyBuffer_Release(&fob);
  PyBuffer_Release(&fsb);
  return ret;
}

/* Call fn(addr, len, ctx) once per run of contiguous offsets of every buffer (without the
 * GIL for a large batch); `stop`: at the first error (else go on, as an unmap must). None, or OSError with the
 * first error. The caller releases the buffers. */
typedef int (*run_fn)(uint64_t addr, uint64_t len, void *ctx);

static PyObject *each_run(Py_buffer *bb, Py_buffer *ob, uint64_t page, run_fn fn, void *ctx, int stop) {
  Py_ssize_t nb, n;
  if (get_u64s(bb, &nb, "bases") || get_u64s(ob, &n, "offsets")) return NULL;
  const uint64_t *bases = bb->buf, *offs = ob->buf;
  int err = 0;
  PyThreadState *ts = maybe_release(nb * n);
  for (Py_ssize_t b = 0; b < nb && !(stop && err); b++) {
    Py_ssize_t i = 0;
    while (i < n && !(stop && err)) {
      Py_ssize_t j = run_end(offs, i, n, page);
      int e = fn(bases[b] + offs[i], (j - i) * page, ctx);
      if (e && !err) err = e;
      i = j;
    }
  }
  reacquire(ts);
  if (err) {
    errno = err;
    return PyErr_SetFromErrno(PyExc_OSError);
  }
  Py_RETURN_NONE;
}

static int rereserve_run(uint64_t addr, uint64_t len, void *ctx) { return host_rereserve(addr, len); }

/* host_unmap(bases, offsets, page_size): back to reserved-only (reads fault). */
static PyObject *host_unmap(PyObject *m, PyObject *args) {
  Py_buffer bb, ob;
  unsigned long long page;
  if (!PyArg_ParseTuple(args, "y*y*O&", &bb, &ob, to_u64, &page)) return NULL;
  PyObject *ret = each_run(&bb, &ob, page, rereserve_run, NULL, 0);
  PyBuffer_Release(&bb);
  PyBuffer_Release(&ob);
  return ret;
}

/* The scratch memfd `fd` of `run` pages of `page` bytes. */
typedef struct {
  int fd;
  uint64_t page, run;
} Scratch;

/* One run of pages backed by the scratch: the page at address a maps the file at
 * ((a / page) % run) * page, one mmap per run-aligned window. */
static int scratch_run(uint64_t addr, uint64_t len, void *ctx) {
  const Scratch *s = ctx;
  for (uint64_t end = addr + len; addr < end;) {
    uint64_t at = (addr / s->page) % s->run, k = s->run - at;
    if (k > (end - addr) / s->page) k = (end - addr) / s->page;
    void *p = mmap((void *)(uintptr_t)addr, k * s->page, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, s->fd,
                   (off_t)(at * s->page));
    if (p == MAP_FAILED) return errno;
    int e = dontfork(p, k * s->page);
    if (e) return e;
    addr += k * s->page;
  }
  return 0;
}

/* host_scratch(bases, offsets, page_size, fd, run_pages)
 * Back the pages at bases[b] + offsets[i] with the scratch memfd `fd` (run_pages pages):
 * the page at address a maps the file at ((a / page) % run_pages) * page, so a run of pages
 * needs one mmap per run_pages-aligned window and scratch mappings side by side merge into
 * one VMA (the kernel merges mappings of one file at consecutive offsets). MAP_FIXED replaces
 * whatever is there (a real page, a reservation) at once: the address is never unbacked.
 * Not atomic: on failure (ENOMEM at vm.max_map_count) some pages may be scratch already. */
static PyObject *host_scratch(PyObject *m, PyObject *args) {
  Py_buffer bb, ob;
  Scratch s;
  if (!PyArg_ParseTuple(args, "y*y*O&iO&", &bb, &ob, to_u64, &s.page, &s.fd, to_u64, &s.run)) return NULL;
  PyObject *ret = NULL;
  if (s.page == 0 || s.run == 0)
    PyErr_SetString(PyExc_ValueError, "host_scratch: page_size and run_pages must be > 0");
  else
    ret = each_run(&bb, &ob, s.page, scratch_run, &s, 1);
  PyBuffer_Release(&bb);
  PyBuffer_Release(&ob);
  return ret;
}

/* ------------------------------------------------------------------------- */
/* CUDA backend: the driver API through dlopen, one CudaDriver per load        */
/* ------------------------------------------------------------------------- */

static PyTypeObject DriverType;

#define LOAD(field, sym)                                  \
  do {                                                    \
    *(void **)(&d->field) = dlsym(d->lib, sym);           \
    if (!d->field) {                                      \
      missing = sym;                                      \
      goto fail;                                          \
    }                                                     \
  } while (0)

/* cuda_load(path=None) -> CudaDriver: dlopen `path` (default: libcuda.so.1 from the loader's
 * search path) and cuInit. OSError when the library or a symbol is missing; DriverError
 * when cuInit fails. The library is never unloaded. */
static PyObject *cuda_load(PyObject *m, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"path", NULL};
  PyObject *path_obj = Py_None, *path_bytes = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|O:cuda_load", kwlist, &path_obj)) return NULL;
  if (path_obj != Py_None && !PyUnicode_FSConverter(path_obj, &path_bytes)) return NULL;
  const char *path = path_bytes ? PyBytes_AS_STRING(path_bytes) : "libcuda.so.1";
  DriverObject *d = PyObject_New(DriverObject, &DriverType);
  if (!d) {
    Py_XDECREF(path_bytes);
    return NULL;
  }
  memset((char *)d + sizeof(PyObject), 0, sizeof(DriverObject) - sizeof(PyObject));
  d->path = PyUnicode_DecodeFSDefault(path);
  if (!d->path) goto error;
  const char *missing = NULL;
  d->lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!d->lib) {
    PyErr_Format(PyExc_OSError, "cannot load %s (no NVIDIA driver?): %s", path, dlerror());
    goto error;
  }
  LOAD(Init, "cuInit");
  LOAD(DeviceGet, "cuDeviceGet");
  LOAD(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
  LOAD(CtxGetCurrent, "cuCtxGetCurrent");
  LOAD(CtxSetCurrent, "cuCtxSetCurrent");
  LOAD(GetErrorName, "cuGetErrorName");
  LOAD(MemGetAllocationGranularity, "cuMemGetAllocationGranularity");
  LOAD(MemAddressReserve, "cuMemAddressReserve");
  LOAD(MemAddressFree, "cuMemAddressFree");
  LOAD(MemCreate, "cuMemCreate");
  LOAD(MemRelease, "cuMemRelease");
  LOAD(MemMap, "cuMemMap");
  LOAD(MemUnmap, "cuMemUnmap");
  LOAD(MemSetAccess, "cuMemSetAccess");
  CUresult rc = d->Init(0);
  if (rc) {
    raise_driver(d, "cuInit", rc);
    goto error;
  }
  Py_XDECREF(path_bytes);
  return (PyObject *)d;
fail:
  PyErr_Format(PyExc_OSError, "%s lacks %s (driver too old for the VMM API)", path, missing);
error:
  Py_XDECREF(path_bytes);
  Py_DECREF(d);
  return NULL;
}

static void Driver_dealloc(DriverObject *d) {
  /* No dlclose: a driver must not be unloaded under contexts that others may still use. */
  Py_XDECREF(d->path);
  PyObject_Free(d);
}

static void device_prop(CUmemAllocationProp *p, int dev) {
  memset(p, 0, sizeof(*p));
  p->type = 1;          /* CU_MEM_ALLOCATION_TYPE_PINNED */
  p->location.type = 1; /* CU_MEM_LOCATION_TYPE_DEVICE */
  p->location.id = dev;
}

static PyObject *Driver_granularity(DriverObject *d, PyObject *args) {
  int dev;
  if (!PyArg_ParseTuple(args, "i", &dev)) return NULL;
  CtxScope scope;
  const char *call;
  CUresult rc = ctx_enter(d, dev, &scope, &call);
  if (rc) return raise_driver(d, call, rc);
  CUmemAllocationProp p;
  device_prop(&p, dev);
  size_t g = 0;
  rc = d->MemGetAllocationGranularity(&g, &p, 0);
  ctx_leave(d, &scope);
  if (rc) return raise_driver(d, "cuMemGetAllocationGranularity", rc);
  return PyLong_FromSize_t(g);
}

static PyObject *Driver_reserve(DriverObject *d, PyObject *args) {
  unsigned long long size, align;
  int dev;
  if (!PyArg_ParseTuple(args, "O&O&i", to_u64, &size, to_u64, &align, &dev)) return NULL;
  CtxScope scope;
  const char *call;
  CUresult rc = ctx_enter(d, dev, &scope, &call);
  if (rc) return raise_driver(d, call, rc);
  CUdeviceptr p = 0;
  Py_BEGIN_ALLOW_THREADS
  rc = d->MemAddressReserve(&p, size, align, 0, 0);
  Py_END_ALLOW_THREADS
  PyObject *r = rc ? NULL : new_range(p, size, KIND_CUDA, dev, d);
  if (!rc && !r) d->MemAddressFree(p, size);
  ctx_leave(d, &scope);
  if (rc) return raise_driver(d, "cuMemAddressReserve", rc);
  return r;
}

/* create(n, size, dev) -> list of n handles; all or nothing. */
static PyObject *Driver_create(DriverObject *d, PyObject *args) {
  Py_ssize_t n;
  unsigned long long size;
  int dev;
  if (!PyArg_ParseTuple(args, "nO&i", &n, to_u64, &size, &dev)) return NULL;
  if (n < 0) {
    PyErr_SetString(PyExc_ValueError, "n must be >= 0");
    return NULL;
  }
  CUmemHandle *h = PyMem_RawCalloc(n ? n : 1, sizeof(CUmemHandle));
  if (!h) return PyErr_NoMemory();
  CtxScope scope;
  const char *call = "cuMemCreate";
  CUresult rc = ctx_enter(d, dev, &scope, &call);
  if (rc) {
    PyMem_RawFree(h);
    return raise_driver(d, call, rc);
  }
  CUmemAllocationProp p;
  device_prop(&p, dev);
  Py_ssize_t i = 0;
  Py_BEGIN_ALLOW_THREADS
  for (; i < n; i++)
    if ((rc = d->MemCreate(&h[i], size, &p, 0))) break;
  if (rc)
    for (Py_ssize_t k = 0; k < i; k++) d->MemRelease(h[k]);
  Py_END_ALLOW_THREADS
  PyObject *out = rc ? NULL : PyList_New(n);
  for (Py_ssize_t k = 0; out && k < n; k++) {
    PyObject *v = PyLong_FromUnsignedLongLong(h[k]);
    if (!v) Py_CLEAR(out);
    else PyList_SET_ITEM(out, k, v);
  }
  if (!rc && !out)
    for (Py_ssize_t k = 0; k < n; k++) d->MemRelease(h[k]); /* nobody holds them: give them back */
  ctx_leave(d, &scope);
  PyMem_RawFree(h);
  if (rc) return raise_driver(d, "cuMemCreate", rc);
  return out;
}

/* release(handles, dev): every handle, then the first error. In the device's context like
 * every other call: close() may run on any thread (the GC's finalizer, vattn-close). */
static PyObject *Driver_release(DriverObject *d, PyObject *args) {
  Py_buffer hb;
  int dev;
  if (!PyArg_ParseTuple(args, "y*i", &hb, &dev)) return NULL;
  PyObject *ret = NULL;
  Py_ssize_t n;
  if (get_u64s(&hb, &n, "handles")) goto out;
  CtxScope scope;
  const char *call = "cuMemRelease";
  CUresult rc = ctx_enter(d, dev, &scope, &call), first = 0;
  if (rc) {
    raise_driver(d, call, rc);
    goto out;
  }
  const CUmemHandle *h = hb.buf;
  Py_BEGIN_ALLOW_THREADS
  for (Py_ssize_t i = 0; i < n; i++)
    if ((rc = d->MemRelease(h[i])) && !first) first = rc;
  Py_END_ALLOW_THREADS
  ctx_leave(d, &scope);
  if (first) {
    raise_driver(d, "cuMemRelease", first);
    goto out;
  }
  ret = Py_None;
  Py_INCREF(ret);
out:
  PyBuffer_Release(&hb);
  return ret;
}

/* map(bases, offsets, handles, page_size, dev)
 * Group i: handles[i * nbuf + b] mapped at bases[b] + offsets[i]. Access is then set
 * once per buffer per run of contiguous offsets (one cuMemSetAccess per run, not per page).
 * Atomic: on failure everything mapped here is unmapped again. */
static PyObject *Driver_map(DriverObject *d, PyObject *args) {
  Py_buffer bb, ob, hb;
  unsigned long long page;
  int dev;
  if (!PyArg_ParseTuple(args, "y*y*y*O&i", &bb, &ob, &hb, to_u64, &page, &dev)) return NULL;
  PyObject *ret = NULL;
  Py_ssize_t nb, n, nh;
  if (get_u64s(&bb, &nb, "bases") || get_u64s(&ob, &n, "offsets") || get_u64s(&hb, &nh, "handles")) goto out;
  if (nh != n * nb) {
    PyErr_SetString(PyExc_ValueError, "map: need one handle per group per buffer");
    goto out;
  }
  CtxScope scope;
  const char *call = "cuMemMap";
  CUresult rc = ctx_enter(d, dev, &scope, &call);
  if (rc) {
    raise_driver(d, call, rc);
    goto out;
  }
  const uint64_t *bases = bb.buf, *offs = ob.buf;
  const CUmemHandle *h = hb.buf;
  CUmemAccessDesc acc;
  memset(&acc, 0, sizeof(acc));
  acc.location.type = 1;
  acc.location.id = dev;
  acc.flags = 3; /* CU_MEM_ACCESS_FLAGS_PROT_READWRITE */
  Py_ssize_t mapped_b = 0, mapped_i = 0;
  Py_BEGIN_ALLOW_THREADS
  for (Py_ssize_t b = 0; b < nb && !rc; b++) {
    Py_ssize_t i = 0;
    for (; i < n; i++) {
      if ((rc = d->MemMap(bases[b] + offs[i], page, 0, h[i * nb + b], 0))) {
        call = "cuMemMap";
        break;
      }
    }
    mapped_b = b;
    mapped_i = i;
    for (Py_ssize_t s = 0; s < i && !rc;) { /* one cuMemSetAccess per contiguous run */
      Py_ssize_t e = run_end(offs, s, i, page);
      if ((rc = d->MemSetAccess(bases[b] + offs[s], (e - s) * page, &acc, 1))) call = "cuMemSetAccess";
      s = e;
    }
  }
  if (rc) {
    for (Py_ssize_t b = 0; b <= mapped_b; b++)
      for (Py_ssize_t i = 0; i < (b < mapped_b ? n : mapped_i); i++) d->MemUnmap(bases[b] + offs[i], page);
  }
  Py_END_ALLOW_THREADS
  ctx_leave(d, &scope);
  if (rc) {
    raise_driver(d, call, rc);
    goto out;
  }
  ret = Py_None;
  Py_INCREF(ret);
out:
  PyBuffer_Release(&bb);
  PyBuffer_Release(&ob);
  PyBuffer_Release(&hb);
  return ret;
}

/* unmap(bases, offsets, page_size, dev): one cuMemUnmap per contiguous run. */
static PyObject *Driver_unmap(DriverObject *d, PyObject *args) {
  Py_buffer bb, ob;
  unsigned long long page;
  int dev;
  if (!PyArg_ParseTuple(args, "y*y*O&i", &bb, &ob, to_u64, &page, &dev)) return NULL;
  PyObject *ret = NULL;
  Py_ssize_t nb, n;
  if (get_u64s(&bb, &nb, "bases") || get_u64s(&ob, &n, "offsets")) goto out;
  CtxScope scope;
  const char *call = "cuMemUnmap";
  CUresult rc = ctx_enter(d, dev, &scope, &call), first = 0;
  if (rc) {
    raise_driver(d, call, rc);
    goto out;
  }
  const uint64_t *bases = bb.buf, *offs = ob.buf;
  Py_BEGIN_ALLOW_THREADS
  for (Py_ssize_t b = 0; b < nb; b++) {
    Py_ssize_t i = 0;
    while (i < n) {
      Py_ssize_t j = run_end(offs, i, n, page);
      if ((rc = d->MemUnmap(bases[b] + offs[i], (j - i) * page)) && !first) first = rc;
      i = j;
    }
  }
  Py_END_ALLOW_THREADS
  ctx_leave(d, &scope);
  if (first) {
    raise_driver(d, "cuMemUnmap", first);
    goto out;
  }
  ret = Py_None;
  Py_INCREF(ret);
out:
  PyBuffer_Release(&bb);
  PyBuffer_Release(&ob);
  return ret;
}

static PyMethodDef Driver_methods[] = {
    {"granularity", (PyCFunction)Driver_granularity, METH_VARARGS, "granularity(device) -> bytes"},
    {"reserve", (PyCFunction)Driver_reserve, METH_VARARGS, "reserve(size, alignment, device) -> Range"},
    {"create", (PyCFunction)Driver_create, METH_VARARGS, "create(n, size, device) -> [handle]; all or nothing"},
    {"release", (PyCFunction)Driver_release, METH_VARARGS, "release(handles, device)"},
    {"map", (PyCFunction)Driver_map, METH_VARARGS, "map(bases, offsets, handles, page_size, device); atomic"},
    {"unmap", (PyCFunction)Driver_unmap, METH_VARARGS, "unmap(bases, offsets, page_size, device)"},
    {NULL}};

static PyMemberDef Driver_members[] = {
    {"path", T_OBJECT, offsetof(DriverObject, path), READONLY, "the library that was loaded"},
    {NULL}};

static PyTypeObject DriverType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "vattn._C.CudaDriver",
    .tp_basicsize = sizeof(DriverObject),
    .tp_dealloc = (destructor)Driver_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One loaded CUDA driver (see cuda_load). Every call runs in the device's primary context and "
              "leaves the caller's context current afterwards.",
    .tp_methods = Driver_methods,
    .tp_members = Driver_members,
};

/* ------------------------------------------------------------------------- */

static PyMethodDef methods[] = {
    {"host_reserve", host_reserve, METH_VARARGS, "host_reserve(size) -> Range (PROT_NONE, MAP_NORESERVE)"},
    {"host_map", host_map, METH_VARARGS, "host_map(bases, offsets, fds, file_offsets, file_strides, page_size)"},
    {"host_unmap", host_unmap, METH_VARARGS, "host_unmap(bases, offsets, page_size)"},
    {"host_scratch", host_scratch, METH_VARARGS,
     "host_scratch(bases, offsets, page_size, fd, run_pages): back the pages with a scratch memfd of run_pages pages"},
    {"cuda_load", (PyCFunction)(void (*)(void))cuda_load, METH_VARARGS | METH_KEYWORDS,
     "cuda_load(path=None) -> CudaDriver: dlopen the driver (default libcuda.so.1) and cuInit"},
    {"dlpack", dlpack_export, METH_VARARGS,
     "dlpack(owner, offset, shape, strides, code, bits, device_type, device_id) -> DLPack capsule viewing "
     "owner.addr + offset (no copy; the view must lie inside owner.size bytes). The capsule and the tensor "
     "keep `owner` alive; the deleter and the capsule's destructor are safe with an exception pending."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "vattn._C", "vattn virtual-memory primitives", -1, methods};

PyMODINIT_FUNC PyInit__C(void) {
  if (PyType_Ready(&RangeType) < 0 || PyType_Ready(&DriverType) < 0) return NULL;
  PyObject *mod = PyModule_Create(&moduledef);
  if (!mod) return NULL;
  DriverError = PyErr_NewException("vattn._C.DriverError", PyExc_RuntimeError, NULL);
  if (!DriverError) {
    Py_DECREF(mod);
    return NULL;
  }
  Py_INCREF(&RangeType);
  Py_INCREF(&DriverType);
  if (PyModule_AddObject(mod, "Range", (PyObject *)&RangeType) < 0 ||
      PyModule_AddObject(mod, "CudaDriver", (PyObject *)&DriverType) < 0 ||
      PyModule_AddObject(mod, "DriverError", DriverError) < 0) {
    Py_DECREF(mod);
    return NULL;
  }
  return mod;
}
