/* A host-memory stand-in for libcuda.so.1, for control-flow tests of the CUDA plugin's adapter.
 *
 * It exports the driver symbols cuda-bindings 12.x resolves, and cuGetProcAddress_v2 (which 13.x
 * requires) answering with those symbols (the "_v2" variant first, as the real driver maps a base
 * name to its newest ABI), and behaves like a synchronous device whose memory is host memory:
 * allocations are aligned_alloc, copies memcpy, events carry a host clock. Kernels cannot run, so a
 * launch executes a host version of two known entries ("scale_ws": ws = 2x, y = ws + 1; "fault":
 * raises CUDA_ERROR_ILLEGAL_ADDRESS at the next synchronisation) and records every launch. Stream
 * capture records launches into a graph that cuGraphLaunch replays.
 *
 * It checks that the adapter calls the real Python bindings correctly (types, return tuples,
 * handles as ints, the ctypes launch path) and that the engine's data flows through it. It is
 * never evidence that the plugin works on a GPU. Environment: STUB_CUDA_VERSION (12080),
 * STUB_CUDA_DEVICES (1), STUB_CUDA_INIT (cuInit's status), STUB_CUDA_CTX_ERROR, STUB_CUDA_ARCH (90).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;

enum { OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3, NO_DEVICE = 100, INVALID_PTX = 218,
       INVALID_HANDLE = 400, NOT_FOUND = 500, NOT_READY = 600, ILLEGAL_ADDRESS = 700, CAPTURE_ILLEGAL = 901 };

static int env_int(const char *name, int fallback) {
    const char *v = getenv(name);
    return v && *v ? atoi(v) : fallback;
}

/* -- introspection for tests (read with ctypes) -------------------------------------------------- */
long long stub_launches = 0, stub_graph_launches = 0, stub_allocs = 0, stub_frees = 0, stub_syncs = 0;
unsigned long long stub_release_threshold = 0;
long long stub_last_n = -1;
void *stub_last_stream = 0;
static int sticky = 0;

typedef struct Function { char name[64]; } Function;
typedef struct Launch { Function *f; void *args[8]; } Launch;
typedef struct Graph { int n; Launch launches[64]; } Graph;
typedef struct Stream { int capturing; Graph *graph; } Stream;
typedef struct Event { double t; } Event;

static double now_ms(void) {
    struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static CUresult run(Function *f, void **args) {
    stub_launches++;
    if (!strcmp(f->name, "scale_ws")) {
        const float *x = (const float *)args[0]; float *y = (float *)args[1];
        int64_t n = (int64_t)args[2]; float *ws = (float *)args[3];
        stub_last_n = n;
        for (int64_t i = 0; i < n; i++) { ws[i] = 2.0f * x[i]; y[i] = ws[i] + 1.0f; }
    } else if (!strcmp(f->name, "fault")) {
        sticky = ILLEGAL_ADDRESS;
    }
    return OK;
}

static CUresult sync_status(void) { stub_syncs++; return sticky; }

/* -- init, devices, contexts ---------------------------------------------------------------------- */
CUresult cuInit(unsigned int flags) { (void)flags; return env_int("STUB_CUDA_INIT", 0); }
CUresult cuDriverGetVersion(int *v) { *v = env_int("STUB_CUDA_VERSION", 12080); return OK; }
CUresult cuDeviceGetCount(int *n) { *n = env_int("STUB_CUDA_DEVICES", 1); return OK; }
CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    if (ordinal < 0 || ordinal >= env_int("STUB_CUDA_DEVICES", 1)) return INVALID_VALUE;
    *d = ordinal; return OK;
}
CUresult cuDeviceGetName(char *name, int len, CUdevice d) { snprintf(name, len, "Stub GPU %d", d); return OK; }
CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice d) {
    (void)d; int arch = env_int("STUB_CUDA_ARCH", 90);
    if (attr == 75) { *v = arch / 10; return OK; }   /* COMPUTE_CAPABILITY_MAJOR */
    if (attr == 76) { *v = arch % 10; return OK; }   /* COMPUTE_CAPABILITY_MINOR */
    *v = 0; return OK;
}
CUresult cuDevicePrimaryCtxRetain(void **ctx, CUdevice d) {
    int err = env_int("STUB_CUDA_CTX_ERROR", 0);
    if (err) return err;
    *ctx = (void *)(uintptr_t)(0x1000 + d); return OK;
}
CUresult cuCtxSetCurrent(void *ctx) { (void)ctx; return OK; }
CUresult cuCtxSynchronize(void) { return sync_status(); }

/* -- streams and events --------------------------------------------------------------------------- */
CUresult cuStreamCreate(void **s, unsigned int flags) {
    (void)flags; *s = calloc(1, sizeof(Stream)); return OK;
}
CUresult cuStreamDestroy_v2(void *s) { free(s); return OK; }
CUresult cuStreamSynchronize(void *s) { (void)s; return sync_status(); }
CUresult cuStreamWaitEvent(void *s, void *e, unsigned int flags) { (void)s; (void)e; (void)flags; return OK; }
CUresult cuStreamIsCapturing(void *s, int *status) { *status = s && ((Stream *)s)->capturing; return OK; }
CUresult cuStreamBeginCapture_v2(void *s, int mode) {
    (void)mode;
    if (!s || (uintptr_t)s <= 2) return CAPTURE_ILLEGAL;
    Stream *st = s; st->capturing = 1; st->graph = calloc(1, sizeof(Graph)); return OK;
}
CUresult cuStreamEndCapture(void *s, void **graph) {
    Stream *st = s; if (!st->capturing) return INVALID_VALUE;
    st->capturing = 0; *graph = st->graph; st->graph = 0; return OK;
}
CUresult cuEventCreate(void **e, unsigned int flags) { (void)flags; *e = calloc(1, sizeof(Event)); return OK; }
CUresult cuEventDestroy_v2(void *e) { free(e); return OK; }
CUresult cuEventRecord(void *e, void *s) { (void)s; ((Event *)e)->t = now_ms(); return OK; }
CUresult cuEventSynchronize(void *e) { (void)e; return sync_status(); }
CUresult cuEventQuery(void *e) { (void)e; return sticky; }
CUresult cuEventElapsedTime(float *ms, void *a, void *b) { *ms = (float)(((Event *)b)->t - ((Event *)a)->t); return OK; }
CUresult cuEventElapsedTime_v2(float *ms, void *a, void *b) { return cuEventElapsedTime(ms, a, b); }

/* -- memory --------------------------------------------------------------------------------------- */
static char pool_object[64];
CUresult cuDeviceGetDefaultMemPool(void **pool, CUdevice d) { (void)d; *pool = pool_object; return OK; }
CUresult cuMemPoolSetAttribute(void *pool, int attr, void *value) {
    if (pool != pool_object) return INVALID_HANDLE;
    if (attr == 4) stub_release_threshold = *(unsigned long long *)value;   /* RELEASE_THRESHOLD */
    return OK;
}
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t n, void *pool, void *s) {
    (void)s;
    if (pool != pool_object || n == 0) return INVALID_VALUE;
    if (n > ((size_t)1 << 40)) return OUT_OF_MEMORY;
    void *m = aligned_alloc(256, (n + 255) / 256 * 256);
    if (!m) return OUT_OF_MEMORY;
    stub_allocs++; *p = (CUdeviceptr)(uintptr_t)m; return OK;
}
CUresult cuMemFreeAsync(CUdeviceptr p, void *s) { (void)s; stub_frees++; free((void *)(uintptr_t)p); return OK; }
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *h, size_t n, void *s) {
    (void)s; memcpy((void *)(uintptr_t)d, h, n); return OK;
}
CUresult cuMemcpyDtoHAsync_v2(void *h, CUdeviceptr d, size_t n, void *s) {
    (void)s; if (sticky) return sticky; memcpy(h, (void *)(uintptr_t)d, n); return OK;
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr src, size_t n, void *s) {
    (void)s; memmove((void *)(uintptr_t)d, (void *)(uintptr_t)src, n); return OK;
}
CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, void *s) {
    (void)s; memset((void *)(uintptr_t)d, v, n); return OK;
}

/* -- modules and launches ------------------------------------------------------------------------- */
CUresult cuModuleLoadData(void **m, const void *image) {
    if (!memcmp(image, "BADIMAGE", 8)) return INVALID_PTX;
    *m = malloc(8); return OK;
}
CUresult cuModuleUnload(void *m) { free(m); return OK; }
CUresult cuModuleGetFunction(void **f, void *m, const char *name) {
    (void)m;
    if (strcmp(name, "scale_ws") && strcmp(name, "fault")) return NOT_FOUND;
    Function *fn = calloc(1, sizeof(Function)); strncpy(fn->name, name, 63); *f = fn; return OK;
}
CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shmem, void *s, void **params, void **extra) {
    (void)gy; (void)gz; (void)by; (void)bz; (void)shmem; (void)extra;
    if (!gx || !bx) return INVALID_VALUE;
    stub_last_stream = s;
    Function *fn = f; void *args[8] = {0};
    int count = !strcmp(fn->name, "scale_ws") ? 4 : 0;
    for (int i = 0; i < count; i++) memcpy(&args[i], params[i], 8);   /* what the driver copies */
    Stream *st = s;
    if (st && (uintptr_t)s > 2 && st->capturing) {
        Graph *g = st->graph; if (g->n >= 64) return INVALID_VALUE;
        g->launches[g->n].f = fn; memcpy(g->launches[g->n].args, args, sizeof args); g->n++;
        return OK;
    }
    return run(fn, args);
}

/* -- graphs --------------------------------------------------------------------------------------- */
CUresult cuGraphInstantiateWithFlags(void **exec, void *graph, unsigned long long flags) {
    (void)flags; Graph *copy = malloc(sizeof(Graph)); memcpy(copy, graph, sizeof(Graph)); *exec = copy; return OK;
}
CUresult cuGraphDestroy(void *g) { free(g); return OK; }
CUresult cuGraphExecDestroy(void *g) { free(g); return OK; }
CUresult cuGraphLaunch(void *exec, void *s) {
    Graph *g = exec; stub_graph_launches++; stub_last_stream = s;
    for (int i = 0; i < g->n; i++) run(g->launches[i].f, g->launches[i].args);
    return OK;
}

/* -- errors --------------------------------------------------------------------------------------- */
CUresult cuGetErrorName(CUresult e, const char **name) {
    switch (e) {
    case OK: *name = "CUDA_SUCCESS"; return OK;
    case INVALID_VALUE: *name = "CUDA_ERROR_INVALID_VALUE"; return OK;
    case OUT_OF_MEMORY: *name = "CUDA_ERROR_OUT_OF_MEMORY"; return OK;
    case NO_DEVICE: *name = "CUDA_ERROR_NO_DEVICE"; return OK;
    case INVALID_PTX: *name = "CUDA_ERROR_INVALID_PTX"; return OK;
    case NOT_FOUND: *name = "CUDA_ERROR_NOT_FOUND"; return OK;
    case ILLEGAL_ADDRESS: *name = "CUDA_ERROR_ILLEGAL_ADDRESS"; return OK;
    case 304: *name = "CUDA_ERROR_OPERATING_SYSTEM"; return OK;
    default: *name = 0; return INVALID_VALUE;
    }
}
CUresult cuGetErrorString(CUresult e, const char **s) { return cuGetErrorName(e, s); }

/* -- symbol lookup (cuda-bindings 13.x resolves every function through this) ------------------------ */
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags, int *status) {
    (void)version; (void)flags;
    void *self = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    char name[160];
    const char *base = !strcmp(symbol, "cuGraphInstantiate") ? "cuGraphInstantiateWithFlags" : symbol;
    snprintf(name, sizeof name, "%s_v2", base);
    void *f = self ? dlsym(self, name) : 0;
    if (!f && self) f = dlsym(self, base);
    if (self) dlclose(self);
    *pfn = f;
    if (status) *status = f ? 0 : 1;   /* CU_GET_PROC_ADDRESS_SUCCESS / SYMBOL_NOT_FOUND */
    return f ? OK : NOT_FOUND;
}
