/* A strict fake of the CUDA driver's virtual memory API, with host memory behind it.
 *
 * Built by the tests into a temporary `libcuda.so.1` (no SONAME, so it never stands in for
 * the real driver that the dynamic loader finds by name) and loaded by vattn's C extension
 * through `_C.cuda_load(path)`. It implements the entry points vattn uses:
 *
 *   reserve  cuMemAddressReserve  mmap(PROT_NONE, MAP_NORESERVE), aligned
 *   create   cuMemCreate          a region of one memfd, all of its own
 *   map      cuMemMap             mmap(MAP_SHARED | MAP_FIXED) of the handle's region, PROT_NONE
 *   access   cuMemSetAccess       mprotect: readable and writable only from here on
 *   unmap    cuMemUnmap           back to a PROT_NONE reservation
 *   release  cuMemRelease         the region's memory goes back (hole punched)
 *   free     cuMemAddressFree     munmap
 *
 * and it enforces the driver's rules, returning real CUresult codes: cuInit first; a current
 * context (per thread) on every VMM call; addresses and sizes aligned to the granularity;
 * maps inside a live reservation and never over a mapping; unmap and set-access only of
 * whole mappings; no double release; cuMemAddressFree only of a whole reservation with
 * nothing mapped in it. Two rules are vattn's own, stricter than the driver: a handle is
 * released only when it is not mapped (the driver would defer the free), and a handle is
 * mapped whole (offset 0, its full size). As on the real driver, one handle may be mapped at
 * several addresses at once (the same memory behind each: vattn's scratch page). Each broken
 * rule is also counted and logged, so tests can assert there were none.
 *
 * Test controls (C functions, called through ctypes on the same library path):
 *   fake_cuda_reset()                        forget call counts, failures, violations, the cap
 *   fake_cuda_set_fail(name, ordinal, code)  the ordinal-th call (1-based, counted from the
 *                                            last reset) of `name` returns `code`
 *   fake_cuda_calls(name)                    calls of `name` since the last reset
 *   fake_cuda_set_memory_limit(bytes)        cuMemCreate past this many live bytes: OUT_OF_MEMORY (0: none)
 *   fake_cuda_set_fill(byte)                 cuMemCreate fills new memory with this byte (-1: zeros, the
 *                                            default; CUDA promises none: 0xff is NaN in every float type)
 *   fake_cuda_set_granularity(bytes)         only while nothing is reserved or created
 *   fake_cuda_num_handles(), _num_mappings(), _num_reservations(), _num_violations()
 *   fake_cuda_violations()                   the logged violations, one per line
 * For cuda-python: cuDriverGetVersion, and cuGetProcAddress(_v2), through which the bindings
 * find every entry point above (tests/vmem/test_cuda_driver.py runs them on the fake).
 * Environment, read when the library loads: VATTN_FAKE_CUDA_FAIL="cuMemMap:3,cuMemCreate:1:2"
 * (name:ordinal[:code], code 999 = CUDA_ERROR_UNKNOWN by default), and
 * VATTN_FAKE_CUDA_GRANULARITY (bytes, default 64 KiB). The fake has FAKE_NUM_DEVICES devices.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct CUctx_st {
  int device;
} *CUcontext;
typedef struct { int type; int id; } CUmemLocation;
typedef struct {
  int type;
  int requestedHandleTypes;
  CUmemLocation location;
  void *win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
} CUmemAllocationProp;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;

enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NOT_INITIALIZED = 3,
  CUDA_ERROR_INVALID_DEVICE = 101,
  CUDA_ERROR_INVALID_CONTEXT = 201,
  CUDA_ERROR_ALREADY_MAPPED = 208,
  CUDA_ERROR_NOT_MAPPED = 211,
  CUDA_ERROR_INVALID_HANDLE = 400,
  CUDA_ERROR_ILLEGAL_STATE = 401,
  CUDA_ERROR_NOT_FOUND = 500,
  CUDA_ERROR_UNKNOWN = 999,
};

#define FAKE_NUM_DEVICES 2
#define MAX_RULES 32
#define MAX_LOG 32

static const struct { int code; const char *name; } error_names[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED"},
    {4, "CUDA_ERROR_DEINITIALIZED"},
    {100, "CUDA_ERROR_NO_DEVICE"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT"},
    {CUDA_ERROR_ALREADY_MAPPED, "CUDA_ERROR_ALREADY_MAPPED"},
    {CUDA_ERROR_NOT_MAPPED, "CUDA_ERROR_NOT_MAPPED"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE"},
    {CUDA_ERROR_ILLEGAL_STATE, "CUDA_ERROR_ILLEGAL_STATE"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN"},
};

/* The entry points, in the order of the call counters. */
static const char *const call_names[] = {
    "cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxGetCurrent", "cuCtxSetCurrent",
    "cuGetErrorName", "cuMemGetAllocationGranularity", "cuMemAddressReserve", "cuMemAddressFree",
    "cuMemCreate", "cuMemRelease", "cuMemMap", "cuMemUnmap", "cuMemSetAccess"};
#define NUM_CALLS (int)(sizeof(call_names) / sizeof(call_names[0]))
enum { C_INIT, C_DEVICE_GET, C_RETAIN, C_GET_CURRENT, C_SET_CURRENT, C_ERROR_NAME, C_GRANULARITY,
       C_RESERVE, C_FREE, C_CREATE, C_RELEASE, C_MAP, C_UNMAP, C_SET_ACCESS };

typedef struct { uint64_t addr, size; } Reservation;
typedef struct { uint64_t addr, size; long handle; int prot; } Mapping; /* handle: index */
typedef struct { uint64_t offset, size; int live, nmaps, device; } Handle;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static __thread CUcontext current; /* the calling thread's current context */
static struct CUctx_st primary[FAKE_NUM_DEVICES];
static int retained[FAKE_NUM_DEVICES];
static int initialized;
static uint64_t granularity = 64 << 10;
static uint64_t memory_limit; /* 0: no cap */
static uint64_t created_bytes;
static int memfd = -1;
static int fill = -1; /* cuMemCreate's new memory: -1 zeros, else this byte (fake_cuda_set_fill) */
static uint64_t memfd_size;

static Reservation *reservations;
static long num_reservations, cap_reservations;
static Mapping *mappings; /* sorted by address, never overlapping */
static long num_mappings, cap_mappings;
static Handle *handles;
static long num_handles_total, cap_handles, live_handles;

static long calls[NUM_CALLS];
static struct { int call; long ordinal; int code; } rules[MAX_RULES];
static int num_rules;
static long violations;
static char log_lines[MAX_LOG][200];
static char log_text[MAX_LOG * 201 + 1];

/* ------------------------------------------------------------------ bookkeeping ---- */

static int grow(void **arr, long *cap, long need, size_t item) {
  if (need <= *cap) return 0;
  long n = *cap ? *cap * 2 : 64;
  while (n < need) n *= 2;
  void *p = realloc(*arr, (size_t)n * item);
  if (!p) return -1;
  *arr = p;
  *cap = n;
  return 0;
}

/* A broken rule: counted, logged, and answered with `code`. */
static CUresult violation(CUresult code, const char *fmt, ...) {
  if (violations < MAX_LOG) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(log_lines[violations], sizeof(log_lines[0]), fmt, ap);
    va_end(ap);
  }
  violations++;
  return code;
}

/* Count the call; an injected failure answers before anything happens. */
static CUresult enter(int call) {
  long n = ++calls[call];
  for (int i = 0; i < num_rules; i++)
    if (rules[i].call == call && rules[i].ordinal == n) return rules[i].code;
  return CUDA_SUCCESS;
}

static int call_index(const char *name) {
  for (int i = 0; i < NUM_CALLS; i++)
    if (name && !strcmp(name, call_names[i])) return i;
  return -1;
}

static int add_rule(const char *name, long ordinal, int code) {
  int c = call_index(name);
  if (c < 0 || ordinal < 1 || num_rules == MAX_RULES) return -1;
  rules[num_rules].call = c;
  rules[num_rules].ordinal = ordinal;
  rules[num_rules].code = code ? code : CUDA_ERROR_UNKNOWN;
  num_rules++;
  return 0;
}

__attribute__((constructor)) static void read_environment(void) {
  const char *g = getenv("VATTN_FAKE_CUDA_GRANULARITY");
  if (g && strtoull(g, NULL, 0) >= 4096) granularity = strtoull(g, NULL, 0);
  const char *spec = getenv("VATTN_FAKE_CUDA_FAIL");
  if (!spec) return;
  char buf[1024];
  snprintf(buf, sizeof(buf), "%s", spec);
  for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
    char *colon = strchr(tok, ':');
    if (!colon) continue;
    *colon = 0;
    char *end;
    long ordinal = strtol(colon + 1, &end, 10);
    int code = *end == ':' ? (int)strtol(end + 1, NULL, 10) : CUDA_ERROR_UNKNOWN;
    add_rule(tok, ordinal, code);
  }
}

static int aligned(uint64_t v) { return v % granularity == 0; }
static int valid_device(int d) { return d >= 0 && d < FAKE_NUM_DEVICES; }

static long find_reservation(uint64_t addr, uint64_t size) { /* the live one holding [addr, addr+size) */
  for (long i = 0; i < num_reservations; i++)
    if (addr >= reservations[i].addr && size <= reservations[i].size &&
        addr - reservations[i].addr <= reservations[i].size - size)
      return i;
  return -1;
}

static long first_mapping_at_or_after(uint64_t addr) { /* binary search */
  long lo = 0, hi = num_mappings;
  while (lo < hi) {
    long mid = (lo + hi) / 2;
    if (mappings[mid].addr < addr) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

static int overlaps_mapping(uint64_t addr, uint64_t size) {
  long i = first_mapping_at_or_after(addr);
  if (i < num_mappings && mappings[i].addr < addr + size) return 1;
  if (i > 0 && mappings[i - 1].addr + mappings[i - 1].size > addr) return 1;
  return 0;
}

/* [addr, addr+size) is exactly a run of whole, adjacent mappings: their index range, or -1. */
static long whole_mappings(uint64_t addr, uint64_t size, long *end) {
  long i = first_mapping_at_or_after(addr), j = i;
  if (i == num_mappings || mappings[i].addr != addr) return -1;
  uint64_t at = addr;
  while (j < num_mappings && mappings[j].addr == at && at < addr + size) at += mappings[j++].size;
  if (at != addr + size) return -1;
  *end = j;
  return i;
}

static Handle *lookup_handle(CUmemGenericAllocationHandle h) {
  if (h == 0 || h > (CUmemGenericAllocationHandle)num_handles_total) return NULL;
  Handle *x = &handles[h - 1];
  return x->live ? x : NULL;
}

#define LOCKED(call_id, body)              \
  do {                                     \
    pthread_mutex_lock(&mu);               \
    CUresult rc_ = enter(call_id);         \
    if (!rc_) rc_ = (body);                \
    pthread_mutex_unlock(&mu);             \
    return rc_;                            \
  } while (0)

static CUresult need_init(const char *call) {
  return initialized ? CUDA_SUCCESS : violation(CUDA_ERROR_NOT_INITIALIZED, "%s before cuInit", call);
}

/* Every VMM call: cuInit done, and a context current on this thread. */
static CUresult need_ctx(const char *call) {
  CUresult rc = need_init(call);
  if (rc) return rc;
  return current ? CUDA_SUCCESS : violation(CUDA_ERROR_INVALID_CONTEXT, "%s with no current context", call);
}

static CUresult check_prop(const CUmemAllocationProp *p, const char *call) {
  if (!p) return violation(CUDA_ERROR_INVALID_VALUE, "%s: prop is NULL", call);
  if (p->type != 1 || p->location.type != 1 || !valid_device(p->location.id))
    return violation(CUDA_ERROR_INVALID_VALUE, "%s: prop is not pinned memory of a device (type %d, location %d:%d)",
                     call, p->type, p->location.type, p->location.id);
  return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ the driver API ---- */

static CUresult do_init(unsigned int flags) {
  if (flags) return violation(CUDA_ERROR_INVALID_VALUE, "cuInit flags %u (must be 0)", flags);
  initialized = 1;
  return CUDA_SUCCESS;
}
CUresult cuInit(unsigned int flags) { LOCKED(C_INIT, do_init(flags)); }

static CUresult do_device_get(CUdevice *d, int ordinal) {
  CUresult rc = need_init("cuDeviceGet");
  if (rc) return rc;
  if (!d) return violation(CUDA_ERROR_INVALID_VALUE, "cuDeviceGet: device is NULL");
  if (!valid_device(ordinal)) return CUDA_ERROR_INVALID_DEVICE;
  *d = ordinal;
  return CUDA_SUCCESS;
}
CUresult cuDeviceGet(CUdevice *d, int ordinal) { LOCKED(C_DEVICE_GET, do_device_get(d, ordinal)); }

static CUresult do_retain(CUcontext *ctx, CUdevice d) {
  CUresult rc = need_init("cuDevicePrimaryCtxRetain");
  if (rc) return rc;
  if (!ctx) return violation(CUDA_ERROR_INVALID_VALUE, "cuDevicePrimaryCtxRetain: ctx is NULL");
  if (!valid_device(d)) return CUDA_ERROR_INVALID_DEVICE;
  primary[d].device = d;
  retained[d]++;
  *ctx = &primary[d];
  return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice d) { LOCKED(C_RETAIN, do_retain(ctx, d)); }

static CUresult do_get_current(CUcontext *ctx) {
  CUresult rc = need_init("cuCtxGetCurrent");
  if (rc) return rc;
  if (!ctx) return violation(CUDA_ERROR_INVALID_VALUE, "cuCtxGetCurrent: ctx is NULL");
  *ctx = current;
  return CUDA_SUCCESS;
}
CUresult cuCtxGetCurrent(CUcontext *ctx) { LOCKED(C_GET_CURRENT, do_get_current(ctx)); }

static CUresult do_set_current(CUcontext ctx) {
  CUresult rc = need_init("cuCtxSetCurrent");
  if (rc) return rc;
  if (ctx) {
    int d = 0;
    while (d < FAKE_NUM_DEVICES && ctx != &primary[d]) d++;
    if (d == FAKE_NUM_DEVICES || !retained[d])
      return violation(CUDA_ERROR_INVALID_CONTEXT, "cuCtxSetCurrent of a context that is not a retained primary context");
  }
  current = ctx;
  return CUDA_SUCCESS;
}
CUresult cuCtxSetCurrent(CUcontext ctx) { LOCKED(C_SET_CURRENT, do_set_current(ctx)); }

static CUresult do_error_name(CUresult code, const char **s) {
  if (!s) return CUDA_ERROR_INVALID_VALUE;
  for (size_t i = 0; i < sizeof(error_names) / sizeof(error_names[0]); i++)
    if (error_names[i].code == code) {
      *s = error_names[i].name;
      return CUDA_SUCCESS;
    }
  *s = NULL;
  return CUDA_ERROR_INVALID_VALUE;
}
CUresult cuGetErrorName(CUresult code, const char **s) { LOCKED(C_ERROR_NAME, do_error_name(code, s)); }

static CUresult do_granularity(size_t *g, const CUmemAllocationProp *prop, int option) {
  const char *call = "cuMemGetAllocationGranularity";
  CUresult rc = need_ctx(call);
  if (rc || (rc = check_prop(prop, call))) return rc;
  if (!g || (option != 0 && option != 1)) return violation(CUDA_ERROR_INVALID_VALUE, "%s: bad arguments", call);
  *g = granularity;
  return CUDA_SUCCESS;
}
CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *prop, int option) {
  LOCKED(C_GRANULARITY, do_granularity(g, prop, option));
}

static CUresult do_reserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr hint, unsigned long long flags) {
  const char *call = "cuMemAddressReserve";
  CUresult rc = need_ctx(call);
  if (rc) return rc;
  if (!ptr || flags) return violation(CUDA_ERROR_INVALID_VALUE, "%s: ptr NULL or flags %llu", call, flags);
  if (!size || !aligned(size))
    return violation(CUDA_ERROR_INVALID_VALUE, "%s: size %zu is not a multiple of the granularity %llu", call, size,
                     (unsigned long long)granularity);
  if (alignment & (alignment - 1)) return violation(CUDA_ERROR_INVALID_VALUE, "%s: alignment %zu is not a power of two", call, alignment);
  uint64_t align = alignment > granularity ? alignment : granularity;
  if (grow((void **)&reservations, &cap_reservations, num_reservations + 1, sizeof(Reservation))) return CUDA_ERROR_OUT_OF_MEMORY;
  void *p = mmap(NULL, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  uint64_t lo = (uint64_t)(uintptr_t)p, start = (lo + align - 1) / align * align;
  if (start > lo) munmap(p, start - lo);
  if (start + size < lo + size + align) munmap((void *)(uintptr_t)(start + size), lo + size + align - start - size);
  reservations[num_reservations].addr = start;
  reservations[num_reservations].size = size;
  num_reservations++;
  *ptr = start;
  (void)hint;
  return CUDA_SUCCESS;
}
CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr, unsigned long long flags) {
  LOCKED(C_RESERVE, do_reserve(ptr, size, alignment, addr, flags));
}

static CUresult do_free(CUdeviceptr ptr, size_t size) {
  const char *call = "cuMemAddressFree";
  CUresult rc = need_ctx(call);
  if (rc) return rc;
  long i = find_reservation(ptr, size);
  if (i < 0 || reservations[i].addr != ptr || reservations[i].size != size)
    return violation(CUDA_ERROR_INVALID_VALUE, "%s(0x%llx, %zu) is not a whole live reservation", call, ptr, size);
  if (overlaps_mapping(ptr, size))
    return violation(CUDA_ERROR_ILLEGAL_STATE, "%s(0x%llx, %zu) with pages still mapped in it", call, ptr, size);
  munmap((void *)(uintptr_t)ptr, size);
  reservations[i] = reservations[--num_reservations];
  return CUDA_SUCCESS;
}
CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) { LOCKED(C_FREE, do_free(ptr, size)); }

static CUresult do_create(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *prop, unsigned long long flags) {
  const char *call = "cuMemCreate";
  CUresult rc = need_ctx(call);
  if (rc || (rc = check_prop(prop, call))) return rc;
  if (!h || flags) return violation(CUDA_ERROR_INVALID_VALUE, "%s: handle NULL or flags %llu", call, flags);
  if (!size || !aligned(size))
    return violation(CUDA_ERROR_INVALID_VALUE, "%s: size %zu is not a multiple of the granularity %llu", call, size,
                     (unsigned long long)granularity);
  if (memory_limit && created_bytes + size > memory_limit) return CUDA_ERROR_OUT_OF_MEMORY;
  if (grow((void **)&handles, &cap_handles, num_handles_total + 1, sizeof(Handle))) return CUDA_ERROR_OUT_OF_MEMORY;
  if (memfd < 0 && (memfd = memfd_create("fake-cuda", MFD_CLOEXEC)) < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  if (ftruncate(memfd, (off_t)(memfd_size + size))) return CUDA_ERROR_OUT_OF_MEMORY;
  if (fill >= 0) { /* what memory new from the driver holds: whatever it held before */
    static unsigned char chunk[1 << 16];
    memset(chunk, fill, sizeof(chunk));
    for (size_t done = 0; done < size; done += sizeof(chunk))
      if (pwrite(memfd, chunk, size - done < sizeof(chunk) ? size - done : sizeof(chunk),
                 (off_t)(memfd_size + done)) < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  }
  Handle *x = &handles[num_handles_total++];
  x->offset = memfd_size;
  x->size = size;
  x->live = 1;
  x->nmaps = 0;
  x->device = prop->location.id;
  memfd_size += size; /* regions are never reused: a stale handle stays invalid */
  created_bytes += size;
  live_handles++;
  *h = (CUmemGenericAllocationHandle)num_handles_total;
  return CUDA_SUCCESS;
}
CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *prop, unsigned long long flags) {
  LOCKED(C_CREATE, do_create(h, size, prop, flags));
}

static CUresult do_release(CUmemGenericAllocationHandle h) {
  const char *call = "cuMemRelease";
  CUresult rc = need_ctx(call);
  if (rc) return rc;
  Handle *x = lookup_handle(h);
  if (!x) return violation(CUDA_ERROR_INVALID_VALUE, "%s(%llu): unknown or already released handle", call, h);
  if (x->nmaps)
    return violation(CUDA_ERROR_ILLEGAL_STATE, "%s(%llu) while it is mapped %d time(s)", call, h, x->nmaps);
  fallocate(memfd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)x->offset, (off_t)x->size);
  x->live = 0;
  created_bytes -= x->size;
  live_handles--;
  return CUDA_SUCCESS;
}
CUresult cuMemRelease(CUmemGenericAllocationHandle h) { LOCKED(C_RELEASE, do_release(h)); }

static CUresult do_map(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h, unsigned long long flags) {
  const char *call = "cuMemMap";
  CUresult rc = need_ctx(call);
  if (rc) return rc;
  Handle *x = lookup_handle(h);
  if (!x) return violation(CUDA_ERROR_INVALID_VALUE, "%s of an unknown or released handle %llu", call, h);
  if (flags || offset || size != x->size)
    return violation(CUDA_ERROR_INVALID_VALUE, "%s: flags %llu, offset %zu, size %zu of a %llu-byte handle (map it whole)",
                     call, flags, offset, size, (unsigned long long)x->size);
  if (!aligned(ptr)) return violation(CUDA_ERROR_INVALID_VALUE, "%s at 0x%llx: not aligned to the granularity", call, ptr);
  if (find_reservation(ptr, size) < 0)
    return violation(CUDA_ERROR_INVALID_VALUE, "%s at 0x%llx (%zu bytes): not inside a live reservation", call, ptr, size);
  if (overlaps_mapping(ptr, size))
    return violation(CUDA_ERROR_ALREADY_MAPPED, "%s at 0x%llx (%zu bytes): over a mapped range", call, ptr, size);
  if (grow((void **)&mappings, &cap_mappings, num_mappings + 1, sizeof(Mapping))) return CUDA_ERROR_OUT_OF_MEMORY;
  void *p = mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, memfd, (off_t)x->offset);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  long i = first_mapping_at_or_after(ptr);
  memmove(&mappings[i + 1], &mappings[i], (size_t)(num_mappings - i) * sizeof(Mapping));
  mappings[i].addr = ptr;
  mappings[i].size = size;
  mappings[i].handle = (long)(x - handles);
  mappings[i].prot = PROT_NONE;
  num_mappings++;
  x->nmaps++;
  return CUDA_SUCCESS;
}
CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h, unsigned long long flags) {
  LOCKED(C_MAP, do_map(ptr, size, offset, h, flags));
}

static CUresult do_unmap(CUdeviceptr ptr, size_t size) {
  const char *call = "cuMemUnmap";
  CUresult rc = need_ctx(call);
  if (rc) return rc;
  long end, i = whole_mappings(ptr, size, &end);
  if (i < 0) return violation(CUDA_ERROR_INVALID_VALUE, "%s(0x%llx, %zu) is not a run of whole mappings", call, ptr, size);
  void *p = mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  for (long k = i; k < end; k++) handles[mappings[k].handle].nmaps--;
  memmove(&mappings[i], &mappings[end], (size_t)(num_mappings - end) * sizeof(Mapping));
  num_mappings -= end - i;
  return CUDA_SUCCESS;
}
CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) { LOCKED(C_UNMAP, do_unmap(ptr, size)); }

static CUresult do_set_access(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
  const char *call = "cuMemSetAccess";
  CUresult rc = need_ctx(call);
  if (rc) return rc;
  if (!desc || !count) return violation(CUDA_ERROR_INVALID_VALUE, "%s: no access descriptors", call);
  int prot = PROT_NONE;
  for (size_t k = 0; k < count; k++) {
    if (desc[k].location.type != 1 || !valid_device(desc[k].location.id) ||
        (desc[k].flags != 0 && desc[k].flags != 1 && desc[k].flags != 3))
      return violation(CUDA_ERROR_INVALID_VALUE, "%s: bad descriptor (location %d:%d, flags %d)", call,
                       desc[k].location.type, desc[k].location.id, desc[k].flags);
    prot |= desc[k].flags == 3 ? PROT_READ | PROT_WRITE : desc[k].flags == 1 ? PROT_READ : PROT_NONE;
  }
  long end, i = whole_mappings(ptr, size, &end);
  if (i < 0) return violation(CUDA_ERROR_INVALID_VALUE, "%s(0x%llx, %zu) is not a run of whole mappings", call, ptr, size);
  if (mprotect((void *)(uintptr_t)ptr, size, prot)) return CUDA_ERROR_UNKNOWN;
  for (long k = i; k < end; k++) mappings[k].prot = prot;
  return CUDA_SUCCESS;
}
CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
  LOCKED(C_SET_ACCESS, do_set_access(ptr, size, desc, count));
}

/* ------------------------------------------------------------- for cuda-python ---- */
/* cuda-python (cuda.bindings 12.x and 13.x) loads libcuda.so.1 by name and looks each driver
 * function up through cuGetProcAddress_v2: here, the fake's own symbol of that name, NULL
 * for the ones it lacks (the bindings fail only the call of one of those). */

CUresult cuDriverGetVersion(int *version) {
  if (!version) return CUDA_ERROR_INVALID_VALUE;
  *version = 13000;
  return CUDA_SUCCESS;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cuda_version, unsigned long long flags,
                             int *status) {
  (void)cuda_version;
  (void)flags;
  if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
  void *fn = NULL, *self;
  Dl_info info;
  if (dladdr((void *)cuGetProcAddress_v2, &info) && (self = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD))) {
    fn = dlsym(self, symbol);
    dlclose(self);
  }
  *pfn = fn;
  if (status) *status = fn ? 0 : 1; /* CU_GET_PROC_ADDRESS_SUCCESS, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
  return fn ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int cuda_version, unsigned long long flags) {
  return cuGetProcAddress_v2(symbol, pfn, cuda_version, flags, NULL);
}

/* ------------------------------------------------------------------ test controls ---- */

void fake_cuda_reset(void) {
  pthread_mutex_lock(&mu);
  memset(calls, 0, sizeof(calls));
  num_rules = 0;
  violations = 0;
  memory_limit = 0;
  fill = -1;
  pthread_mutex_unlock(&mu);
}

int fake_cuda_set_fail(const char *name, long ordinal, int code) {
  pthread_mutex_lock(&mu);
  int rc = add_rule(name, ordinal, code);
  pthread_mutex_unlock(&mu);
  return rc;
}

long fake_cuda_calls(const char *name) {
  int c = call_index(name);
  return c < 0 ? -1 : calls[c];
}

void fake_cuda_set_memory_limit(unsigned long long bytes) { memory_limit = bytes; }
void fake_cuda_set_fill(int byte) { fill = byte; }

int fake_cuda_set_granularity(unsigned long long bytes) {
  pthread_mutex_lock(&mu);
  int ok = bytes >= 4096 && bytes % 4096 == 0 && !num_reservations && !live_handles;
  if (ok) granularity = bytes;
  pthread_mutex_unlock(&mu);
  return ok ? 0 : -1;
}

long fake_cuda_num_handles(void) { return live_handles; }
long fake_cuda_num_mappings(void) { return num_mappings; }
long fake_cuda_num_reservations(void) { return num_reservations; }
long fake_cuda_num_violations(void) { return violations; }

const char *fake_cuda_violations(void) {
  pthread_mutex_lock(&mu);
  log_text[0] = 0;
  for (long i = 0; i < violations && i < MAX_LOG; i++) {
    strcat(log_text, log_lines[i]);
    strcat(log_text, "\n");
  }
  pthread_mutex_unlock(&mu);
  return log_text;
}
