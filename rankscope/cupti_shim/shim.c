// rankscope CUPTI shim: loaded by the CUDA driver from CUDA_INJECTION64_PATH (or into a running job that was
// not started with it, by `rankscope --inject-shim`: rankscope_shim_attach below), it turns on CUPTI activity
// records for kernels, memcpys and memsets and hands the completed records to the rankscope agent through
// USDT probes. The agent attaches rankscope:activities: the records of a completed buffer are copied into a
// compact array (struct rankscope_record, 48 bytes) and handed over ACTIVITY_BATCH at a time, one uprobe trap
// per batch that the agent's BPF program reads in one go (bpf/cupti.bpf.c on_activities). An agent without
// it attaches rankscope:activity, one trap per record (~0.75 us each, hence its rate limit). Each probe has a
// semaphore: while no agent is attached, completed buffers are returned to CUPTI unread, so the shim costs
// nothing beyond CUPTI's own record keeping.
//
// A second probe, rankscope:launch, with its own semaphore, hands over kernel launches (runtime and driver API
// records) so the agent can join each kernel to its launch by correlation id. API records cost CUPTI time on
// every call of the job, so the shim enables them only while an agent wants them (its deep mode): a thread of
// the shim's own looks at the semaphore once a flush period and turns the API kinds on or off. No CUPTI
// callbacks: nothing runs in the job's API-calling threads.
//
// One shim per CUDA major (RANKSCOPE_CUPTI_MAJOR, set by build.py with the line's headers): libcupti.so.MAJOR
// is opened at run time (the copy the process already maps, e.g. torch's, else RANKSCOPE_CUPTI_LIB, else the
// soname from the loader's path), so the shim links against nothing CUDA and loads anywhere. CUPTI writes its
// records in its own release's layout, read here with the compiled headers' record types: a CUPTI whose API
// version is outside RANKSCOPE_CUPTI_API_MIN..MAX (the releases whose layouts were compared, cuda_lines.py)
// is refused at start, never decoded on trust.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cupti.h>

#define _SDT_HAS_SEMAPHORES 1
#include <sys/sdt.h>

#include "periodic.h"

#define SHIM_API __attribute__((visibility("default")))
#define STR(x) #x
#define XSTR(x) STR(x)
#define CUPTI_SONAME "libcupti.so." XSTR(RANKSCOPE_CUPTI_MAJOR)

// The kernel record of the compiled headers' release (CUPTI 13.0 renamed it when it appended fields; every
// field read here keeps its offset across the accepted releases).
#if CUPTI_API_VERSION >= 130000
typedef CUpti_ActivityKernel10 kernel_record;
#else
typedef CUpti_ActivityKernel9 kernel_record;
#endif
#define BUFFER_BYTES (1u << 20)
#define DEFAULT_MAX_RATE 50000  // records/s of the one-trap-per-record probe; the rest are dropped
// Records per trap of rankscope:activities: the agent's BPF program walks them in a bounded loop of as many
// steps (bpf/cupti.bpf.c ACTIVITY_BATCH, which must match), which the BPF verifier refuses beyond ~24.
// 48 bytes each: 768 bytes of CUPTI's thread's stack.
#define ACTIVITY_BATCH 16

// The USDT semaphore of rankscope:activity; the kernel increments it while an agent's uprobe is attached.
SHIM_API unsigned short rankscope_activity_semaphore __attribute__((section(".probes")));
// The semaphore of rankscope:launch: API records are enabled while it is up.
SHIM_API unsigned short rankscope_launch_semaphore __attribute__((section(".probes")));
// The semaphore of rankscope:activities, the batched hand-over; while it is up, rankscope:activity and
// rankscope:launch are not fired (their records go into the batches).
SHIM_API unsigned short rankscope_activities_semaphore __attribute__((section(".probes")));

// One record of a batch (bpf/cupti.bpf.c struct shim_record): activity records (kernel, memcpy, memset)
// and, while launches are wanted, launch API records (kind RUNTIME or DRIVER: start and end of the call,
// stream = thread id, bytes = callback id).
struct rankscope_record {
    uint32_t kind;
    uint32_t device;
    uint64_t start;
    uint64_t end;
    uint32_t stream;
    uint32_t correlation;
    uint64_t name;  // CUPTI's kernel name string, 0 for other kinds
    uint64_t bytes;
};
_Static_assert(sizeof(struct rankscope_record) == 48, "the BPF side reads 48-byte records");

// Counters a test (or a debugger) reads through rankscope_shim_stats.
struct rankscope_shim_stats {
    uint64_t emitted;          // records handed to the probe
    uint64_t dropped;          // records over the rate limit
    uint64_t skipped_buffers;  // buffers returned unread: no agent attached
    uint64_t cupti_dropped;    // records CUPTI itself dropped (buffers full)
    uint64_t launches;         // launch records handed to rankscope:launch
    uint64_t launches_dropped; // launch records over the rate limit
    uint64_t api_wanted;       // 1 while the shim wants API records (the launch semaphore was up)
    uint64_t api_failures;     // cuptiActivityEnable/Disable calls CUPTI refused
    uint64_t handovers;        // uprobe traps fired: one per record (activity, launch) or per batch
};

// Per-probe rate limiter: the current second and records emitted in it.
struct rate {
    _Atomic uint64_t second, in_second;
};
static struct {
    _Atomic uint64_t emitted, dropped, skipped_buffers, cupti_dropped, launches, launches_dropped, api_failures,
        handovers;
    _Atomic int api_wanted;
    struct rate activity, launch;
    uint64_t max_rate;
} stats;

static struct {
    CUptiResult (*subscribe)(CUpti_SubscriberHandle *, CUpti_CallbackFunc, void *);
    CUptiResult (*unsubscribe)(CUpti_SubscriberHandle);
    CUptiResult (*register_callbacks)(CUpti_BuffersCallbackRequestFunc, CUpti_BuffersCallbackCompleteFunc);
    CUptiResult (*enable)(CUpti_ActivityKind);
    CUptiResult (*disable)(CUpti_ActivityKind);
    CUptiResult (*next_record)(uint8_t *, size_t, CUpti_Activity **);
    CUptiResult (*flush_all)(uint32_t);
    CUptiResult (*flush_period)(uint32_t);
    CUptiResult (*dropped_records)(CUcontext, uint32_t, size_t *);
    CUptiResult (*result_string)(CUptiResult, const char **);
    CUptiResult (*get_version)(uint32_t *);
} cupti;

static void say(const char *what, CUptiResult rc) {
    const char *msg = "unknown error";
    if (cupti.result_string)
        cupti.result_string(rc, &msg);
    fprintf(stderr, "rankscope-cupti: %s (%s)\n", what, msg);
}

static void *open_cupti(void) {
    void *h = dlopen(CUPTI_SONAME, RTLD_NOW | RTLD_NOLOAD);
    const char *path = getenv("RANKSCOPE_CUPTI_LIB");
    if (!h && path && *path)
        h = dlopen(path, RTLD_NOW);
    if (!h)
        h = dlopen(CUPTI_SONAME, RTLD_NOW);
    return h;
}

static int resolve(void *h) {
#define SYM(field, name) if (!(cupti.field = dlsym(h, name))) return -1
    SYM(subscribe, "cuptiSubscribe");
    SYM(unsubscribe, "cuptiUnsubscribe");
    SYM(register_callbacks, "cuptiActivityRegisterCallbacks");
    SYM(enable, "cuptiActivityEnable");
    SYM(disable, "cuptiActivityDisable");
    SYM(next_record, "cuptiActivityGetNextRecord");
    SYM(flush_all, "cuptiActivityFlushAll");
    SYM(flush_period, "cuptiActivityFlushPeriod");
    SYM(dropped_records, "cuptiActivityGetNumDroppedRecords");
    SYM(result_string, "cuptiGetResultString");
    SYM(get_version, "cuptiGetVersion");
#undef SYM
    return 0;
}

static int under_rate_limit(struct rate *r) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    uint64_t now = (uint64_t)ts.tv_sec;
    uint64_t second = atomic_load(&r->second);
    if (now != second && atomic_compare_exchange_strong(&r->second, &second, now))
        atomic_store(&r->in_second, 0);
    return atomic_fetch_add(&r->in_second, 1) < stats.max_rate;
}

// Every argument widened to 64 bits, so each has one size at every probe site (bcc reads an argument
// with a single size).
#define EMIT(kind, start, end, device, stream, correlation, name, bytes)                                     \
    STAP_PROBE8(rankscope, activity, (uint64_t)(kind), (uint64_t)(start), (uint64_t)(end), (uint64_t)(device), \
                (uint64_t)(stream), (uint64_t)(correlation), (uint64_t)(name), (uint64_t)(bytes))

// An activity record (kernel, memcpy, memset) in the compact form of both hand-overs; 0 for other kinds.
static int to_record(const CUpti_Activity *rec, struct rankscope_record *r) {
    switch (rec->kind) {
    case CUPTI_ACTIVITY_KIND_KERNEL:
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        const kernel_record *k = (const void *)rec;
        *r = (struct rankscope_record){rec->kind, k->deviceId, k->start, k->end, k->streamId, k->correlationId,
                                       (uintptr_t)k->name, 0};
        return 1;
    }
    case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const CUpti_ActivityMemcpy6 *m = (const void *)rec;
        *r = (struct rankscope_record){rec->kind, m->deviceId, m->start, m->end, m->streamId, m->correlationId,
                                       0, m->bytes};
        return 1;
    }
    case CUPTI_ACTIVITY_KIND_MEMSET: {
        const CUpti_ActivityMemset4 *m = (const void *)rec;
        *r = (struct rankscope_record){rec->kind, m->deviceId, m->start, m->end, m->streamId, m->correlationId,
                                       0, m->bytes};
        return 1;
    }
    default:
        return 0;
    }
}

// One record to the probe. Args: kind, GPU start ns, GPU end ns, device, stream, correlation id,
// kernel name (char *, NULL for copies and sets; CUPTI shares one string per kernel), bytes (copies, sets).
static void emit(const CUpti_Activity *rec) {
    struct rankscope_record r;
    if (!to_record(rec, &r))
        return;
    EMIT(r.kind, r.start, r.end, r.device, r.stream, r.correlation, r.name, r.bytes);
    atomic_fetch_add(&stats.emitted, 1);
    atomic_fetch_add(&stats.handovers, 1);
}

// The API calls that launch GPU work, by callback id (enum names of the pinned CUPTI headers).
static int is_launch(CUpti_ActivityKind kind, uint32_t cbid) {
    if (kind == CUPTI_ACTIVITY_KIND_RUNTIME)
        switch (cbid) {
        case CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000:
        case CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_ptsz_v7000:
        case CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernelExC_v11060:
        case CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernelExC_ptsz_v11060:
        case CUPTI_RUNTIME_TRACE_CBID_cudaGraphLaunch_v10000:
        case CUPTI_RUNTIME_TRACE_CBID_cudaGraphLaunch_ptsz_v10000:
            return 1;
        }
    if (kind == CUPTI_ACTIVITY_KIND_DRIVER)
        switch (cbid) {
        case CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel:
        case CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel_ptsz:
        case CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx:
        case CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx_ptsz:
        case CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch:
        case CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch_ptsz:
            return 1;
        }
    return 0;
}

// One launch to rankscope:launch(correlation, API start ns, API end ns, thread id, callback id). A runtime
// launch and the driver call inside it share a correlation id: the agent keeps the first.
static void emit_launch(const CUpti_ActivityAPI *a) {
    if (!is_launch(a->kind, a->cbid))
        return;
    if (!under_rate_limit(&stats.launch)) {
        atomic_fetch_add(&stats.launches_dropped, 1);
        return;
    }
    STAP_PROBE5(rankscope, launch, (uint64_t)a->correlationId, (uint64_t)a->start, (uint64_t)a->end,
                (uint64_t)a->threadId, (uint64_t)a->cbid);
    atomic_fetch_add(&stats.launches, 1);
    atomic_fetch_add(&stats.handovers, 1);
}

// A batch being filled for rankscope:activities.
struct batch {
    struct rankscope_record records[ACTIVITY_BATCH];
    uint32_t count;
    uint32_t activities, launches;  // of each, in the batch
};

// Hands the batch to the probe: (records, count, records lost so far). Lost: records CUPTI dropped (its
// buffers full) and records the per-record probe dropped over its rate limit; the agent serves the total.
static void hand_over(struct batch *b) {
    if (!b->count)
        return;
    uint64_t lost = atomic_load(&stats.cupti_dropped) + atomic_load(&stats.dropped) +
                    atomic_load(&stats.launches_dropped);
    STAP_PROBE3(rankscope, activities, (uint64_t)(uintptr_t)b->records, (uint64_t)b->count, lost);
    atomic_fetch_add(&stats.emitted, b->activities);
    atomic_fetch_add(&stats.launches, b->launches);
    atomic_fetch_add(&stats.handovers, 1);
    b->count = b->activities = b->launches = 0;
}

// Appends a record to the batch (activity records, and launches while wanted), handing it over when full.
static void batch_add(struct batch *b, const CUpti_Activity *rec, int launches) {
    struct rankscope_record *r = &b->records[b->count];
    if (rec->kind == CUPTI_ACTIVITY_KIND_RUNTIME || rec->kind == CUPTI_ACTIVITY_KIND_DRIVER) {
        const CUpti_ActivityAPI *a = (const void *)rec;
        if (!launches || !is_launch(a->kind, a->cbid))
            return;
        *r = (struct rankscope_record){rec->kind, 0, a->start, a->end, a->threadId, a->correlationId, 0, a->cbid};
        b->launches++;
    } else if (to_record(rec, r)) {
        b->activities++;
    } else {
        return;
    }
    if (++b->count == ACTIVITY_BATCH)
        hand_over(b);
}

// The batched hand-over of a completed buffer: every activity record, and launch records while the launch
// semaphore is up. No rate limit: with one trap per ACTIVITY_BATCH records, a record costs CUPTI's thread
// ~0.2 us in all (scripts/bench shim), and no record is dropped.
static void process_batched(uint8_t *buffer, size_t valid) {
    struct batch b = {.count = 0};
    int launches = rankscope_launch_semaphore != 0;
    CUpti_Activity *rec = NULL;
    while (cupti.next_record(buffer, valid, &rec) == CUPTI_SUCCESS)
        batch_add(&b, rec, launches);
    hand_over(&b);
}

// API records on while the launch semaphore is up, off when it goes down. A refusal (no driver, another
// tool) is counted, never said: the job goes on, and the agent simply sees no launches. Called by the
// shim's watcher thread every flush period (exposed so tests can call it in its place).
SHIM_API void rankscope_shim_follow_launch_semaphore(void) {
    int want = rankscope_launch_semaphore != 0;
    int was = atomic_load(&stats.api_wanted);
    if (want == was || !atomic_compare_exchange_strong(&stats.api_wanted, &was, want))
        return;
    CUptiResult (*set)(CUpti_ActivityKind) = want ? cupti.enable : cupti.disable;
    if (set(CUPTI_ACTIVITY_KIND_RUNTIME) != CUPTI_SUCCESS)
        atomic_fetch_add(&stats.api_failures, 1);
    if (set(CUPTI_ACTIVITY_KIND_DRIVER) != CUPTI_SUCCESS)
        atomic_fetch_add(&stats.api_failures, 1);
}

// Walks a completed buffer (without freeing it). Exposed so tests can feed it records built with the real
// CUPTI types; the completed-buffer callback below is its only caller in a job.
SHIM_API void rankscope_shim_process_buffer(uint8_t *buffer, size_t valid) {
    if (!cupti.next_record) {
        atomic_fetch_add(&stats.skipped_buffers, 1);
        return;
    }
    if (rankscope_activities_semaphore) {
        process_batched(buffer, valid);
        return;
    }
    int activity = rankscope_activity_semaphore != 0, launches = rankscope_launch_semaphore != 0;
    if (!activity && !launches) {
        atomic_fetch_add(&stats.skipped_buffers, 1);
        return;
    }
    CUpti_Activity *rec = NULL;
    while (cupti.next_record(buffer, valid, &rec) == CUPTI_SUCCESS) {
        if (rec->kind == CUPTI_ACTIVITY_KIND_RUNTIME || rec->kind == CUPTI_ACTIVITY_KIND_DRIVER) {
            if (launches)
                emit_launch((const CUpti_ActivityAPI *)rec);
        } else if (!activity) {
            continue;
        } else if (under_rate_limit(&stats.activity)) {
            emit(rec);
        } else {
            atomic_fetch_add(&stats.dropped, 1);
        }
    }
}

SHIM_API void rankscope_shim_stats(struct rankscope_shim_stats *out) {
    out->emitted = atomic_load(&stats.emitted);
    out->dropped = atomic_load(&stats.dropped);
    out->skipped_buffers = atomic_load(&stats.skipped_buffers);
    out->cupti_dropped = atomic_load(&stats.cupti_dropped);
    out->launches = atomic_load(&stats.launches);
    out->launches_dropped = atomic_load(&stats.launches_dropped);
    out->api_wanted = (uint64_t)atomic_load(&stats.api_wanted);
    out->api_failures = atomic_load(&stats.api_failures);
    out->handovers = atomic_load(&stats.handovers);
}

// Once a flush period, on the shim's watcher thread: API records follow the launch semaphore and, while an
// agent is attached, CUPTI hands over its partly filled buffers too. CUPTI's own flush period returns full
// buffers only (its documentation says so; on an H200, a job's ~1,700 kernel records of 30 steps never
// reached the probe), so the records of a job launching few kernels would reach the agent late, or never.
static void every_flush_period(void) {
    rankscope_shim_follow_launch_semaphore();
    if (rankscope_activity_semaphore || rankscope_launch_semaphore || rankscope_activities_semaphore)
        cupti.flush_all(0);  // completed records only: never waits for the GPU
}

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    *buffer = aligned_alloc(8, BUFFER_BYTES);
    *size = *buffer ? BUFFER_BYTES : 0;
    *max_records = 0;  // as many as fit
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size, size_t valid) {
    (void)size;
    rankscope_shim_process_buffer(buffer, valid);
    size_t lost = 0;
    if (cupti.dropped_records(ctx, stream, &lost) == CUPTI_SUCCESS && lost)
        atomic_fetch_add(&stats.cupti_dropped, lost);
    free(buffer);
}

static void flush_at_exit(void) {
    cupti.flush_all(1);  // CUPTI_ACTIVITY_FLAG_FLUSH_FORCED: also the records of unfinished buffers
}

static void CUPTIAPI ignore_callback(void *ud, CUpti_CallbackDomain d, CUpti_CallbackId id, const void *data) {
    (void)ud; (void)d; (void)id; (void)data;
}

// Entry point called by the CUDA driver at cuInit. Returns 1 (the driver ignores the value) whether or not
// CUPTI could be set up: the job must never fail because of its observer. Once per process: a late attach
// (rankscope_shim_attach) racing a cuInit that also names the shim sets CUPTI up once.
SHIM_API int InitializeInjection(void) {
    static atomic_flag done = ATOMIC_FLAG_INIT;
    if (atomic_flag_test_and_set(&done))
        return 1;
    const char *rate = getenv("RANKSCOPE_SHIM_MAX_RATE");
    stats.max_rate = rate && *rate ? strtoull(rate, NULL, 10) : DEFAULT_MAX_RATE;
    void *h = open_cupti();
    if (!h || resolve(h)) {
        fprintf(stderr, "rankscope-cupti: " CUPTI_SONAME " not found (set RANKSCOPE_CUPTI_LIB); "
                        "GPU activity is not reported\n");
        return 1;
    }
    uint32_t version = 0;
    if (cupti.get_version(&version) != CUPTI_SUCCESS || version < RANKSCOPE_CUPTI_API_MIN ||
        version > RANKSCOPE_CUPTI_API_MAX) {
        fprintf(stderr, "rankscope-cupti: CUPTI API version %u is not one this shim reads (%u to %u, CUDA "
                        XSTR(RANKSCOPE_CUPTI_MAJOR) "); load the shim of the job's CUDA line, or a newer "
                        "rankscope; GPU activity is not reported\n", version, RANKSCOPE_CUPTI_API_MIN,
                RANKSCOPE_CUPTI_API_MAX);
        cupti.next_record = NULL;  // buffers, if any arrive, go back unread
        return 1;
    }
    // CUPTI allows one subscriber per process: if another tool (Nsight, a profiler) holds it, yield.
    // The subscription is only a probe for that; released at once so a later torch.profiler can take it.
    CUpti_SubscriberHandle sub;
    CUptiResult rc = cupti.subscribe(&sub, ignore_callback, NULL);
    if (rc != CUPTI_SUCCESS) {
        say("another CUPTI subscriber is active or CUPTI is unavailable; GPU activity is not reported", rc);
        return 1;
    }
    cupti.unsubscribe(sub);
    if ((rc = cupti.register_callbacks(buffer_requested, buffer_completed)) != CUPTI_SUCCESS) {
        say("cannot register activity buffers; GPU activity is not reported", rc);
        return 1;
    }
    static const CUpti_ActivityKind kinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                                               CUPTI_ACTIVITY_KIND_MEMSET};
    for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++)
        if ((rc = cupti.enable(kinds[i])) != CUPTI_SUCCESS) {
            say("cannot enable activity records; GPU activity is not reported", rc);
            return 1;
        }
    // CUPTI hands over full buffers once a flush period (partly filled ones: every_flush_period).
    if ((rc = cupti.flush_period(rankscope_flush_period_ms())) != CUPTI_SUCCESS)
        say("cannot set the flush period; records arrive when buffers fill", rc);
    // CUPTI's API record kinds are switched from a thread of the shim's own: never from CUPTI's buffer
    // callback (CUPTI calls made inside its own callbacks are what CUPTI restricts) nor from the job's threads.
    if (rankscope_every_flush_period("rankscope-cupti", every_flush_period) != 0)
        fprintf(stderr, "rankscope-cupti: no watcher thread; kernels are not joined to their launches\n");
    atexit(flush_at_exit);
    return 1;
}

static void *attach_late(void *unused) {
    (void)unused;
    InitializeInjection();
    return NULL;
}

// Entry point of a late attach: an agent that loaded the shim into a running process (agent/inject) calls it
// on a job thread it holds. CUPTI's set-up (loading libcupti, enabling records on live contexts: up to
// hundreds of ms) runs on a thread of the shim's own, so that job thread is given back at once. CUPTI, as for
// torch.profiler, records the kernels launched from then on. The thread (and the watcher thread it starts)
// blocks every signal: the job's signals stay with the job's threads. Returns 0, or pthread_create's error.
SHIM_API int rankscope_shim_attach(void) {
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_t t;
    int rc = pthread_create(&t, NULL, attach_late, NULL);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc)
        return rc;
    pthread_setname_np(t, "rankscope-init");
    pthread_detach(t);
    return 0;
}
