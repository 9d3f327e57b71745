/* Stand-in libcuda.so.1 for machines without GPUs (rankscope simulator).
 *
 * Exports CUDA driver API names with their real C signatures (x86-64 SysV), so that uprobes decode
 * arguments exactly as on a GPU node, and models a GPU's timing:
 *   - each stream is a timeline; a launch or an async copy returns at once after appending work that
 *     starts at max(stream tail, now);
 *   - a kernel lasts gridDim * blockDim threads at 1 thread/ns (1,000,000 threads per ms) times the
 *     GPU factor (rsim_set_gpu_factor); a copy lasts bytes / 20 GB/s;
 *   - synchronizes block (sleeping, never spinning) until the work before them is done;
 *   - libnccl.so.2 appends collectives whose end is only known once every rank arrived (external entries,
 *     see rsim.h); work behind such an entry starts after it, and is resolved lazily.
 * Nothing is computed and no memory is copied: device pointers are addresses of nothing. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "rsim.h"

#define API RSIM_EXPORT

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUevent_st *CUevent;
typedef struct CUfunc_st *CUfunction;
typedef struct CUmod_st *CUmodule;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUlaunchAttribute_st CUlaunchAttribute;

typedef struct CUlaunchConfig_st {
    unsigned int gridDimX;
    unsigned int gridDimY;
    unsigned int gridDimZ;
    unsigned int blockDimX;
    unsigned int blockDimY;
    unsigned int blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    CUlaunchAttribute *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

_Static_assert(offsetof(CUlaunchConfig, blockDimX) == 12, "CUlaunchConfig layout");
_Static_assert(offsetof(CUlaunchConfig, sharedMemBytes) == 24, "CUlaunchConfig layout");
_Static_assert(offsetof(CUlaunchConfig, hStream) == 32, "CUlaunchConfig layout");
_Static_assert(offsetof(CUlaunchConfig, attrs) == 40, "CUlaunchConfig layout");
_Static_assert(offsetof(CUlaunchConfig, numAttrs) == 48, "CUlaunchConfig layout");

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_UNKNOWN = 999, /* also: a wait interrupted by a signal (rsim_set_interruptible) */
};

#define NUM_DEVICES 8
#define COPY_BYTES_PER_NS 20.0   /* 20 GB/s */
#define THREADS_PER_NS 1.0       /* 1,000,000 threads per millisecond */
#define MAGIC_STREAM 0x5354524dU
#define MAGIC_EVENT 0x4556454eU
#define MAGIC_FUNC 0x46554e43U

/* ---------------------------------------------------------------- timeline */

enum entry_kind { E_DURATION, E_EVENT, E_EXTERNAL };

struct entry {
    struct entry *next;
    enum entry_kind kind;
    int64_t enq;  /* enqueue time: the earliest start */
    int64_t dur;  /* E_DURATION */
    struct CUevent_st *ev; /* E_EVENT */
    uint64_t ev_gen;
    const rsim_ext_ops *ops; /* E_EXTERNAL */
    void *ctx;
};

struct CUstream_st {
    uint32_t magic;
    int destroyed;
    int64_t tail;                /* end of the resolved work */
    struct entry *head, *last;   /* unresolved work, in order; the head's start is known */
    struct CUstream_st *next_all;
};

struct CUevent_st {
    uint32_t magic;
    int done;                    /* the recorded position has been reached (at `time`) */
    int64_t time;
    uint64_t gen;                /* bumped by every record: a stale marker does not complete it */
    struct CUstream_st *stream;  /* where it was last recorded */
};

struct CUfunc_st {
    uint32_t magic;
    char name[256];
};

struct CUmod_st {
    uint32_t magic;
};

struct CUctx_st {
    CUdevice device;
    unsigned int flags;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct CUstream_st default_stream = {.magic = MAGIC_STREAM};
static struct CUstream_st *all_streams = &default_stream;
static volatile double gpu_factor = 1.0;
static volatile int interruptible;
static volatile int interrupt_fd = -1;
static int initialized;
static CUdeviceptr next_devptr = 0x7f2000000000ULL;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

static struct CUstream_st *stream_of(CUstream s) { return s ? s : &default_stream; }

static int valid_stream(struct CUstream_st *s) { return s->magic == MAGIC_STREAM && !s->destroyed; }

static void append(struct CUstream_st *s, struct entry *e) {
    e->next = NULL;
    if (s->last)
        s->last->next = e;
    else
        s->head = e;
    s->last = e;
}

/* Resolves the stream's queue as far as possible (lock held). Returns 1 when every entry is resolved,
 * 0 when an external entry is still pending (then *w, if given, says what to wait on). */
static int resolve(struct CUstream_st *s, rsim_waiter *w) {
    while (s->head) {
        struct entry *e = s->head;
        int64_t start = max64(s->tail, e->enq);
        switch (e->kind) {
        case E_DURATION:
            s->tail = start + e->dur;
            break;
        case E_EVENT:
            if (e->ev->gen == e->ev_gen) {
                e->ev->time = start;
                e->ev->done = 1;
            }
            break;
        case E_EXTERNAL: {
            int64_t end = e->ops->poll(e->ctx, start, w);
            if (end < 0)
                return 0;
            e->ops->release(e->ctx);
            s->tail = max64(end, start);
            break;
        }
        }
        s->head = e->next;
        if (!s->head)
            s->last = NULL;
        free(e);
    }
    return 1;
}

/* Appends `dur` ns of work (a kernel or a copy); never blocks. */
static CUresult enqueue_work(CUstream hs, int64_t dur) {
    struct CUstream_st *s = stream_of(hs);
    if (!valid_stream(s))
        return CUDA_ERROR_INVALID_HANDLE;
    int64_t now = now_ns();
    pthread_mutex_lock(&lock);
    resolve(s, NULL);
    if (!s->head) {
        s->tail = max64(s->tail, now) + dur;
    } else {
        struct entry *e = calloc(1, sizeof(*e));
        if (!e) {
            pthread_mutex_unlock(&lock);
            return CUDA_ERROR_UNKNOWN;
        }
        e->kind = E_DURATION;
        e->enq = now;
        e->dur = dur;
        append(s, e);
    }
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

/* Whether a signal arrived since interruption was set up: its handler wrote to the interrupt fd (a pipe the
 * interpreter's wake-up fd writes to; the byte stays there, so this is not racy). */
static int interrupt_pending(void) {
    int fd = interrupt_fd;
    if (fd < 0)
        return 0;
    struct pollfd p = {.fd = fd, .events = POLLIN};
    return poll(&p, 1, 0) > 0;
}

static int sleep_until(int64_t deadline) {
    struct timespec ts = {.tv_sec = deadline / 1000000000LL, .tv_nsec = deadline % 1000000000LL};
    for (;;) {
        int64_t now = now_ns();
        if (now >= deadline)
            return 0;
        int fd = interrupt_fd;
        if (fd >= 0) { /* sleep, but wake up at once when a signal's byte arrives */
            struct timespec rel = {.tv_sec = (deadline - now) / 1000000000LL,
                                   .tv_nsec = (deadline - now) % 1000000000LL};
            struct pollfd p = {.fd = fd, .events = POLLIN};
            int n = ppoll(&p, 1, &rel, NULL);
            if (n > 0 || (n < 0 && errno == EINTR))
                return -1;
            continue;
        }
        int rc = clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL);
        if (rc == 0)
            return 0;
        if (rc == EINTR && interruptible)
            return -1;
        if (rc != EINTR)
            return 0;
    }
}

/* Blocks until the work queued on `s` so far is done. */
static CUresult stream_sync(struct CUstream_st *s) {
    for (;;) {
        rsim_waiter w = {0};
        pthread_mutex_lock(&lock);
        int done = resolve(s, &w);
        int64_t tail = s->tail;
        pthread_mutex_unlock(&lock);
        if (done)
            return sleep_until(tail) ? CUDA_ERROR_UNKNOWN : CUDA_SUCCESS;
        int rc = interrupt_pending() ? -1 : w.wait(w.obj, w.token);
        w.unref(w.obj);
        if (rc)
            return CUDA_ERROR_UNKNOWN;
    }
}

static uint64_t kernel_ns(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz) {
    double threads = (double)gx * gy * gz * bx * by * bz;
    return (uint64_t)(threads / THREADS_PER_NS * gpu_factor);
}

static CUresult launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                       unsigned bz, CUstream stream) {
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!f || f->magic != MAGIC_FUNC)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!gx || !gy || !gz || !bx || !by || !bz || (uint64_t)bx * by * bz > 1024)
        return CUDA_ERROR_INVALID_VALUE;
    return enqueue_work(stream, (int64_t)kernel_ns(gx, gy, gz, bx, by, bz));
}

static CUresult launch_ex(const CUlaunchConfig *config, CUfunction f) {
    if (!config)
        return CUDA_ERROR_INVALID_VALUE;
    return launch(f, config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX,
                  config->blockDimY, config->blockDimZ, config->hStream);
}

static CUresult copy_async(size_t bytes, CUstream stream) {
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    return enqueue_work(stream, (int64_t)((double)bytes / COPY_BYTES_PER_NS));
}

static CUresult event_record(CUevent ev, CUstream hs) {
    struct CUstream_st *s = stream_of(hs);
    if (!ev || ev->magic != MAGIC_EVENT || !valid_stream(s))
        return CUDA_ERROR_INVALID_HANDLE;
    int64_t now = now_ns();
    pthread_mutex_lock(&lock);
    resolve(s, NULL);
    ev->gen++;
    ev->stream = s;
    if (!s->head) {
        ev->time = max64(s->tail, now);
        ev->done = 1;
    } else {
        struct entry *e = calloc(1, sizeof(*e));
        if (!e) {
            pthread_mutex_unlock(&lock);
            return CUDA_ERROR_UNKNOWN;
        }
        ev->done = 0;
        e->kind = E_EVENT;
        e->enq = now;
        e->ev = ev;
        e->ev_gen = ev->gen;
        append(s, e);
    }
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------- helpers for libnccl and the simulator */

RSIM_EXPORT int64_t rsim_now_ns(void) { return now_ns(); }

RSIM_EXPORT int rsim_sleep_until(int64_t deadline) { return sleep_until(deadline); }

RSIM_EXPORT int rsim_interruptible(void) { return interruptible; }

RSIM_EXPORT int rsim_interrupt_pending(void) { return interrupt_pending(); }

RSIM_EXPORT int rsim_stream_enqueue_external(CUstream hs, const rsim_ext_ops *ops, void *ctx) {
    struct CUstream_st *s = stream_of(hs);
    if (!ops || !valid_stream(s))
        return -1;
    struct entry *e = calloc(1, sizeof(*e));
    if (!e)
        return -1;
    e->kind = E_EXTERNAL;
    e->enq = now_ns();
    e->ops = ops;
    e->ctx = ctx;
    pthread_mutex_lock(&lock);
    append(s, e);
    resolve(s, NULL); /* publishes the arrival at once when the start is already known */
    pthread_mutex_unlock(&lock);
    return 0;
}

/* Simulator knob (not a CUDA name): kernel durations are multiplied by `factor` (a slow GPU). */
RSIM_EXPORT void rsim_set_gpu_factor(double factor) {
    if (factor > 0)
        gpu_factor = factor;
}

RSIM_EXPORT double rsim_get_gpu_factor(void) { return gpu_factor; }

/* Simulator knob: when on, synchronizes interrupted by a signal handler return CUDA_ERROR_UNKNOWN (999)
 * instead of resuming, so that an interpreter can run its handler (exit cleanly on SIGTERM). */
RSIM_EXPORT void rsim_set_interruptible(int on) { interruptible = on != 0; }

/* Simulator knob: as rsim_set_interruptible(1), and waits also end when `fd` becomes readable: give it the
 * read end of the pipe whose write end is the interpreter's signal wake-up fd (Python: signal.set_wakeup_fd),
 * so that a signal arriving between two waits is not missed. -1: no fd. */
RSIM_EXPORT void rsim_set_interrupt_fd(int fd) {
    interrupt_fd = fd;
    if (fd >= 0)
        interruptible = 1;
}

/* ---------------------------------------------------------------- CUDA driver API */

API CUresult cuInit(unsigned int flags) {
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    initialized = 1;
    return CUDA_SUCCESS;
}

API CUresult cuDriverGetVersion(int *version) {
    if (!version)
        return CUDA_ERROR_INVALID_VALUE;
    *version = 12040;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetCount(int *count) {
    if (!count)
        return CUDA_ERROR_INVALID_VALUE;
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    *count = NUM_DEVICES;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (ordinal < 0 || ordinal >= NUM_DEVICES)
        return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

API CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (dev < 0 || dev >= NUM_DEVICES)
        return CUDA_ERROR_INVALID_DEVICE;
    struct CUctx_st *c = calloc(1, sizeof(*c));
    if (!c)
        return CUDA_ERROR_UNKNOWN;
    c->device = dev;
    c->flags = flags;
    *pctx = c;
    return CUDA_SUCCESS;
}

API CUresult cuCtxDestroy_v2(CUcontext ctx) {
    if (!ctx)
        return CUDA_ERROR_INVALID_CONTEXT;
    free(ctx);
    return CUDA_SUCCESS;
}

API CUresult cuStreamCreate(CUstream *phStream, unsigned int flags) {
    (void)flags;
    if (!phStream)
        return CUDA_ERROR_INVALID_VALUE;
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    struct CUstream_st *s = calloc(1, sizeof(*s));
    if (!s)
        return CUDA_ERROR_UNKNOWN;
    s->magic = MAGIC_STREAM;
    pthread_mutex_lock(&lock);
    s->next_all = all_streams;
    all_streams = s;
    pthread_mutex_unlock(&lock);
    *phStream = s;
    return CUDA_SUCCESS;
}

/* Waits for the stream's work, then retires it (the small struct stays allocated: events may point at it). */
API CUresult cuStreamDestroy_v2(CUstream hStream) {
    if (!hStream || !valid_stream(hStream))
        return CUDA_ERROR_INVALID_HANDLE;
    CUresult rc = stream_sync(hStream);
    hStream->destroyed = 1;
    return rc;
}

API CUresult cuStreamSynchronize(CUstream hStream) {
    struct CUstream_st *s = stream_of(hStream);
    if (!valid_stream(s))
        return CUDA_ERROR_INVALID_HANDLE;
    return stream_sync(s);
}

API CUresult cuStreamSynchronize_ptsz(CUstream hStream) {
    struct CUstream_st *s = stream_of(hStream);
    if (!valid_stream(s))
        return CUDA_ERROR_INVALID_HANDLE;
    return stream_sync(s);
}

API CUresult cuStreamQuery(CUstream hStream) {
    struct CUstream_st *s = stream_of(hStream);
    if (!valid_stream(s))
        return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&lock);
    int done = resolve(s, NULL) && s->tail <= now_ns();
    pthread_mutex_unlock(&lock);
    return done ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

API CUresult cuCtxSynchronize(void) {
    pthread_mutex_lock(&lock);
    struct CUstream_st *first = all_streams;
    pthread_mutex_unlock(&lock);
    for (struct CUstream_st *s = first; s; s = s->next_all) { /* streams are never freed */
        if (s->destroyed)
            continue;
        CUresult rc = stream_sync(s);
        if (rc)
            return rc;
    }
    return CUDA_SUCCESS;
}

API CUresult cuModuleLoadData(CUmodule *module, const void *image) {
    if (!module || !image)
        return CUDA_ERROR_INVALID_VALUE;
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    struct CUmod_st *m = calloc(1, sizeof(*m));
    if (!m)
        return CUDA_ERROR_UNKNOWN;
    *module = m;
    return CUDA_SUCCESS;
}

API CUresult cuModuleUnload(CUmodule hmod) {
    if (!hmod)
        return CUDA_ERROR_INVALID_HANDLE;
    free(hmod);
    return CUDA_SUCCESS;
}

/* Every name exists in the stand-in modules; the function handle remembers it (cuFuncGetName). */
API CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name) {
    if (!hfunc || !name)
        return CUDA_ERROR_INVALID_VALUE;
    if (!hmod)
        return CUDA_ERROR_INVALID_HANDLE;
    struct CUfunc_st *f = calloc(1, sizeof(*f));
    if (!f)
        return CUDA_ERROR_UNKNOWN;
    f->magic = MAGIC_FUNC;
    strncpy(f->name, name, sizeof(f->name) - 1);
    *hfunc = f;
    return CUDA_SUCCESS;
}

API CUresult cuFuncGetName(const char **name, CUfunction hfunc) {
    if (!name)
        return CUDA_ERROR_INVALID_VALUE;
    if (!hfunc || hfunc->magic != MAGIC_FUNC)
        return CUDA_ERROR_INVALID_HANDLE;
    *name = hfunc->name;
    return CUDA_SUCCESS;
}

API CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                            unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                            unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra) {
    (void)sharedMemBytes, (void)kernelParams, (void)extra;
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream);
}

API CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                 unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                 unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                 void **kernelParams, void **extra) {
    (void)sharedMemBytes, (void)kernelParams, (void)extra;
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream);
}

API CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra) {
    (void)kernelParams, (void)extra;
    return launch_ex(config, f);
}

API CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                                   void **extra) {
    (void)kernelParams, (void)extra;
    return launch_ex(config, f);
}

/* No graph API in the stand-in: exported so that probes find the name. */
API CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream) {
    (void)hGraphExec, (void)hStream;
    return CUDA_ERROR_INVALID_HANDLE;
}

API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    if (!dptr || bytesize == 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    pthread_mutex_lock(&lock);
    *dptr = next_devptr;
    next_devptr += (bytesize + 511) & ~(size_t)511;
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

API CUresult cuMemFree_v2(CUdeviceptr dptr) {
    return dptr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                                  CUstream hStream) {
    (void)dstDevice, (void)srcHost;
    return copy_async(ByteCount, hStream);
}

API CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                                       CUstream hStream) {
    (void)dstDevice, (void)srcHost;
    return copy_async(ByteCount, hStream);
}

API CUresult cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream) {
    (void)dstHost, (void)srcDevice;
    return copy_async(ByteCount, hStream);
}

API CUresult cuMemcpyDtoHAsync_v2_ptsz(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,
                                       CUstream hStream) {
    (void)dstHost, (void)srcDevice;
    return copy_async(ByteCount, hStream);
}

API CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags) {
    (void)Flags;
    if (!phEvent)
        return CUDA_ERROR_INVALID_VALUE;
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    struct CUevent_st *ev = calloc(1, sizeof(*ev));
    if (!ev)
        return CUDA_ERROR_UNKNOWN;
    ev->magic = MAGIC_EVENT;
    ev->done = 1; /* never recorded: complete */
    *phEvent = ev;
    return CUDA_SUCCESS;
}

API CUresult cuEventRecord(CUevent hEvent, CUstream hStream) { return event_record(hEvent, hStream); }

API CUresult cuEventRecord_ptsz(CUevent hEvent, CUstream hStream) { return event_record(hEvent, hStream); }

API CUresult cuEventQuery(CUevent hEvent) {
    if (!hEvent || hEvent->magic != MAGIC_EVENT)
        return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&lock);
    if (!hEvent->done && hEvent->stream)
        resolve(hEvent->stream, NULL);
    int done = hEvent->done && hEvent->time <= now_ns();
    pthread_mutex_unlock(&lock);
    return done ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

API CUresult cuEventSynchronize(CUevent hEvent) {
    if (!hEvent || hEvent->magic != MAGIC_EVENT)
        return CUDA_ERROR_INVALID_HANDLE;
    for (;;) {
        rsim_waiter w = {0};
        pthread_mutex_lock(&lock);
        int done = hEvent->done;
        int64_t t = hEvent->time;
        if (!done && hEvent->stream) {
            int drained = resolve(hEvent->stream, &w);
            done = hEvent->done;
            t = hEvent->time;
            if (done && w.obj) { /* reached; the entry still pending behind it does not matter */
                w.unref(w.obj);
                w.obj = NULL;
            }
            if (!done && drained) { /* its marker was retired (destroyed): nothing left to wait for */
                done = 1;
                t = hEvent->stream->tail;
            }
        } else if (!done) {
            done = 1;
            t = 0;
        }
        pthread_mutex_unlock(&lock);
        if (done)
            return sleep_until(t) ? CUDA_ERROR_UNKNOWN : CUDA_SUCCESS;
        int rc = interrupt_pending() ? -1 : w.wait(w.obj, w.token);
        w.unref(w.obj);
        if (rc)
            return CUDA_ERROR_UNKNOWN;
    }
}

API CUresult cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd) {
    if (!pMilliseconds)
        return CUDA_ERROR_INVALID_VALUE;
    if (!hStart || !hEnd || hStart->magic != MAGIC_EVENT || hEnd->magic != MAGIC_EVENT)
        return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&lock);
    int done = hStart->done && hEnd->done;
    int64_t dt = hEnd->time - hStart->time;
    pthread_mutex_unlock(&lock);
    if (!done)
        return CUDA_ERROR_NOT_READY;
    *pMilliseconds = (float)((double)dt / 1e6);
    return CUDA_SUCCESS;
}

API CUresult cuEventDestroy_v2(CUevent hEvent) {
    if (!hEvent || hEvent->magic != MAGIC_EVENT)
        return CUDA_ERROR_INVALID_HANDLE;
    /* A marker may still point at it: keep the memory, only retire the handle's generation. */
    pthread_mutex_lock(&lock);
    hEvent->gen++;
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}
