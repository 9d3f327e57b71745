// rankscope NCCL profiler plugin: the same library as the CUPTI shim, loaded by NCCL when the job sets
// NCCL_PROFILER_PLUGIN to its path. It gives the agent NCCL's own view of communication:
//
// - rankscope:nccl_coll, once per collective (or send/recv task): its GPU-side duration, from the first
//   channel's kernel start to the last channel's end on the GPU's global timer (NCCL's KernelCh events).
//   NCCL gives no KernelCh events, so no span, for: a communicator of one rank (its collectives are a plain
//   copy outside NCCL's planner, no event at all), a send/recv to self (no proxy op; in place, not even run),
//   and CollNet collectives (their nChannels is left at 0, so the last channel is never known). A test of
//   this probe needs a communicator of two ranks or more.
// - rankscope:nccl_link, once a flush period per (communicator, peer, direction): the network steps of NCCL's
//   proxy thread summed in place (ProxyOp/ProxyStep events): bytes, time on the wire, and for sends the time
//   spent waiting for the receiver's credit. A slow link shows on one (src, dst) pair; a slow node on all
//   of its pairs (C4's src x dst matrix, built by the analyzer).
//
// Cost while no agent is attached: none. NCCL reads the activation mask the plugin owns at every collective or
// send/recv call (a mask raised later applies from the next call; tasks already enqueued keep the old one),
// and the plugin keeps it at 0 until one of the probes' semaphores is up (a watcher thread follows them once
// a flush period). While attached, the proxy thread does a clock read and a few atomic adds per step; the
// USDT traps come once per collective and once per link per flush period, never per step.
//
// NCCL's profiler ABI, versions 4 to 7, each exported (NCCL takes the newest it knows: 2.25-2.27 v4, 2.28 v5,
// 2.29-2.30 v6, 2.31-2.32 v7, as the cu13 wheels' libnccl look them up), declared below from NCCL's plugin
// headers (src/include/plugin/profiler/profiler_v*.h): plugins carry their own copy of the structs by design.
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#define _SDT_HAS_SEMAPHORES 1
#include <sys/sdt.h>

#include "periodic.h"

#define SHIM_API __attribute__((visibility("default")))

// --- NCCL profiler ABI v4 to v7 ------------------------------------------------------------------------
typedef enum { nccl_success = 0, nccl_internal_error = 3 } nccl_result_t;
typedef void (*nccl_logger_t)(int level, unsigned long flags, const char *file, int line, const char *fmt, ...);

enum {  // event types (also the bits of the activation mask)
    EV_GROUP = 1 << 0, EV_COLL = 1 << 1, EV_P2P = 1 << 2, EV_PROXY_OP = 1 << 3, EV_PROXY_STEP = 1 << 4,
    EV_KERNEL_CH = 1 << 6,
};
enum {  // event states
    ST_SEND_GPU_WAIT = 8, ST_SEND_WAIT = 9, ST_RECV_WAIT = 10, ST_RECV_FLUSH_WAIT = 11, ST_RECV_GPU_WAIT = 12,
    ST_SEND_PEER_WAIT = 20, ST_KERNEL_CH_STOP = 22,
};

// The descriptor's union, the members read here. v5 to v7 only add members after these (the API, copy-engine
// and kernel-phase events) and fields at the ends of coll and p2p (parentGroup, kernelVariant, userTag), so
// these are laid out alike in every version; NCCL passes a pointer, so the union's full size does not matter.
typedef union {
    struct {
        uint64_t seq;
        const char *func;
        const void *send_buff;
        void *recv_buff;
        size_t count;
        int root;
        const char *datatype;
        uint8_t n_channels, n_warps;
        const char *algo, *proto;
    } coll;
    struct {
        const char *func;
        void *buff;
        const char *datatype;
        size_t count;
        int peer;
        uint8_t n_channels;
    } p2p;
    struct {
        pid_t pid;
        uint8_t channel;
        int peer, n_steps, chunk_size, is_send;
    } proxy_op;
    struct {
        int step;
    } proxy_step;
    struct {
        uint8_t channel;
        uint64_t ptimer;
    } kernel_ch;
} nccl_event_body_t;

typedef struct {
    uint8_t type;
    void *parent;
    int rank;
    nccl_event_body_t body;
} nccl_event_descr_v4_t;

typedef struct {  // v5 widened the type to 64 bits (event types past bit 7); v6 and v7 keep this header
    uint64_t type;
    void *parent;
    int rank;
    nccl_event_body_t body;
} nccl_event_descr_v5_t;

typedef union {  // the same in v4 to v7
    struct {
        size_t trans_size;
    } proxy_step;
    struct {
        uint64_t ptimer;
    } kernel_ch;
} nccl_event_state_args_t;

typedef struct {
    const char *name;
    nccl_result_t (*init)(void **context, int *mask, const char *comm_name, uint64_t comm_hash, int n_nodes,
                          int nranks, int rank, nccl_logger_t log);
    nccl_result_t (*start_event)(void *context, void **handle, nccl_event_descr_v4_t *descr);
    nccl_result_t (*stop_event)(void *handle);
    nccl_result_t (*record_event_state)(void *handle, int state, nccl_event_state_args_t *args);
    nccl_result_t (*finalize)(void *context);
} nccl_profiler_v4_t;

typedef struct {  // v5 to v7: init takes the communicator id before the mask
    const char *name;
    nccl_result_t (*init)(void **context, uint64_t comm_id, int *mask, const char *comm_name, int n_nodes,
                          int nranks, int rank, nccl_logger_t log);
    nccl_result_t (*start_event)(void *context, void **handle, nccl_event_descr_v5_t *descr);
    nccl_result_t (*stop_event)(void *handle);
    nccl_result_t (*record_event_state)(void *handle, int state, nccl_event_state_args_t *args);
    nccl_result_t (*finalize)(void *context);
} nccl_profiler_v5_t;

// --- probes -------------------------------------------------------------------------------------------
SHIM_API unsigned short rankscope_nccl_coll_semaphore __attribute__((section(".probes")));
SHIM_API unsigned short rankscope_nccl_link_semaphore __attribute__((section(".probes")));

#define COLL_EVENTS (EV_COLL | EV_P2P | EV_KERNEL_CH)
#define LINK_EVENTS (EV_PROXY_OP | EV_PROXY_STEP)
#define TASK_SLOTS 128   // tasks in flight per communicator (enqueued, GPU not done); NCCL itself tracks 64
#define LINK_SLOTS 64    // (peer, direction) pairs per communicator: a ring or tree uses 2-6, all-to-all more
#define STEP_SLOTS 8     // NCCL_STEPS: a proxy op has at most this many steps in flight
#define MAX_CONTEXTS 64  // communicators of one process

// Objects behind the handles NCCL holds; each starts with its event type.
struct context;
struct task {  // a collective or send/recv task, for its GPU-side span
    uint8_t type;
    struct context *ctx;
    const char *func;
    uint64_t seq, bytes, first_start, last_stop;
    int channels, channels_done;
};
struct kernel_ch {
    uint8_t type;
    struct task *task;
    uint64_t start;
};
struct link {  // one (peer, direction), summed until the watcher hands it over
    _Atomic uint32_t key;  // peer * 2 + send + 1; 0: free
    _Atomic uint64_t steps, bytes, wire_ns, peer_wait_ns;
};
struct proxy_op;
struct step {
    uint8_t type;
    struct proxy_op *op;
    int state;
    uint64_t since;  // CLOCK_MONOTONIC ns of the state's start
    uint64_t trans_size;
};
struct proxy_op {
    uint8_t type;
    struct link *link;  // NULL: the communicator's link table is full (counted in links_dropped)
    int is_send;
    struct step steps[STEP_SLOTS];
};
struct context {
    uint64_t comm_hash;
    int rank, nranks;
    _Atomic uint32_t next_task;
    struct task tasks[TASK_SLOTS];
    struct link links[LINK_SLOTS];
};

static struct {
    pthread_mutex_t lock;  // guards contexts (the watcher walks them; init and finalize change them)
    struct context *contexts[MAX_CONTEXTS];
    int *mask;  // NCCL's activation mask, read by NCCL before each task
    int watcher_started;
    _Atomic uint64_t colls, links_emitted, links_dropped;
} plugin = {.lock = PTHREAD_MUTEX_INITIALIZER};

static const uint8_t group_event = EV_GROUP;  // groups carry nothing: one shared handle

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static size_t datatype_bytes(const char *name) {
    static const struct { const char *name; size_t bytes; } types[] = {
        {"ncclInt8", 1}, {"ncclUint8", 1}, {"ncclFloat8e4m3", 1}, {"ncclFloat8e5m2", 1}, {"ncclInt32", 4},
        {"ncclUint32", 4}, {"ncclFloat32", 4}, {"ncclInt64", 8}, {"ncclUint64", 8}, {"ncclFloat64", 8},
        {"ncclFloat16", 2}, {"ncclBfloat16", 2}};
    for (size_t i = 0; name && i < sizeof(types) / sizeof(types[0]); i++)
        if (strcmp(name, types[i].name) == 0)
            return types[i].bytes;
    return 0;  // unknown type: the span is still timed, without bytes
}

// The mask NCCL should use for what the attached agent wants; called by the watcher every flush period.
static int wanted_mask(void) {
    return (rankscope_nccl_coll_semaphore ? COLL_EVENTS : 0) | (rankscope_nccl_link_semaphore ? LINK_EVENTS : 0);
}

static struct link *find_link(struct context *ctx, int peer, int is_send) {
    uint32_t key = (uint32_t)peer * 2 + (is_send ? 1 : 0) + 1;
    for (uint32_t i = 0; i < LINK_SLOTS; i++) {
        struct link *l = &ctx->links[(key + i) % LINK_SLOTS];
        uint32_t seen = atomic_load(&l->key);
        if (seen == 0 && atomic_compare_exchange_strong(&l->key, &seen, key))
            return l;
        if (seen == key)  // also after a lost race: the CAS left the winner's key in `seen`
            return l;
    }
    atomic_fetch_add(&plugin.links_dropped, 1);
    return NULL;
}

// Hands over one communicator's link sums (each read and reset at once) to rankscope:nccl_link.
static void flush_links(struct context *ctx, int emit) {
    for (int i = 0; i < LINK_SLOTS; i++) {
        struct link *l = &ctx->links[i];
        uint32_t key = atomic_load(&l->key);
        if (!key || !atomic_load(&l->steps))
            continue;
        uint64_t steps = atomic_exchange(&l->steps, 0), bytes = atomic_exchange(&l->bytes, 0);
        uint64_t wire = atomic_exchange(&l->wire_ns, 0), wait = atomic_exchange(&l->peer_wait_ns, 0);
        if (!emit)
            continue;
        STAP_PROBE8(rankscope, nccl_link, ctx->comm_hash, (uint64_t)ctx->rank, (uint64_t)((key - 1) / 2),
                    (uint64_t)((key - 1) % 2), steps, bytes, wire, wait);
        atomic_fetch_add(&plugin.links_emitted, 1);
    }
}

// One watcher period: set NCCL's mask to what the attached agent wants and hand over the link sums.
// Exposed so tests can call it in the watcher's place.
SHIM_API void rankscope_nccl_follow_semaphores(void) {
    pthread_mutex_lock(&plugin.lock);
    if (plugin.mask)
        __atomic_store_n(plugin.mask, wanted_mask(), __ATOMIC_RELAXED);
    int emit = rankscope_nccl_link_semaphore != 0;
    for (int i = 0; i < MAX_CONTEXTS; i++)
        if (plugin.contexts[i])
            flush_links(plugin.contexts[i], emit);
    pthread_mutex_unlock(&plugin.lock);
}

// Called with plugin.lock held.
static void start_watcher(void) {
    if (plugin.watcher_started++)
        return;
    if (rankscope_every_flush_period("rankscope-nccl", rankscope_nccl_follow_semaphores) != 0)
        fprintf(stderr, "rankscope-nccl: no watcher thread; NCCL events stay off\n");
}

static nccl_result_t init(void **context, int *mask, uint64_t comm_hash, int rank, int nranks) {
    *context = NULL;
    struct context *ctx = calloc(1, sizeof(*ctx));
    if (!ctx)
        return nccl_internal_error;  // NCCL then runs without the plugin
    ctx->comm_hash = comm_hash;
    ctx->rank = rank;
    ctx->nranks = nranks;
    pthread_mutex_lock(&plugin.lock);
    int slot = 0;
    while (slot < MAX_CONTEXTS && plugin.contexts[slot])
        slot++;
    if (slot == MAX_CONTEXTS) {
        pthread_mutex_unlock(&plugin.lock);
        free(ctx);
        return nccl_internal_error;
    }
    plugin.contexts[slot] = ctx;
    plugin.mask = mask;
    __atomic_store_n(mask, wanted_mask(), __ATOMIC_RELAXED);
    start_watcher();
    pthread_mutex_unlock(&plugin.lock);
    *context = ctx;
    return nccl_success;
}

static nccl_result_t finalize(void *context) {
    struct context *ctx = context;
    pthread_mutex_lock(&plugin.lock);
    int left = 0;
    for (int i = 0; i < MAX_CONTEXTS; i++) {
        if (plugin.contexts[i] == ctx)
            plugin.contexts[i] = NULL;
        left += plugin.contexts[i] != NULL;
    }
    flush_links(ctx, rankscope_nccl_link_semaphore != 0);  // the last steps of a communicator count too
    if (!left)
        plugin.mask = NULL;  // NCCL may unload with its last communicator
    pthread_mutex_unlock(&plugin.lock);
    free(ctx);
    return nccl_success;
}

static void *start_task(struct context *ctx, const char *func, const char *datatype, size_t count, int channels,
                        uint64_t seq) {
    struct task *t = &ctx->tasks[atomic_fetch_add(&ctx->next_task, 1) % TASK_SLOTS];
    *t = (struct task){.type = EV_COLL, .ctx = ctx, .func = func, .seq = seq,
                       .bytes = (uint64_t)count * datatype_bytes(datatype), .channels = channels};
    return t;
}

static void *start_kernel_ch(struct task *task, uint64_t start) {
    struct kernel_ch *k = malloc(sizeof(*k));
    if (k)
        *k = (struct kernel_ch){.type = EV_KERNEL_CH, .task = task, .start = start};
    return k;
}

// A channel's kernel work ended: the task's span grows; when its last channel ends, the span goes out.
static void stop_kernel_ch(struct kernel_ch *k, uint64_t stop) {
    struct task *t = k->task;
    if (!t->first_start || k->start < t->first_start)
        t->first_start = k->start;
    if (stop > t->last_stop)
        t->last_stop = stop;
    if (++t->channels_done != t->channels || !rankscope_nccl_coll_semaphore)
        return;
    STAP_PROBE6(rankscope, nccl_coll, t->ctx->comm_hash, (uint64_t)t->ctx->rank, (uint64_t)(uintptr_t)t->func,
                t->bytes, t->last_stop - t->first_start, t->seq);
    atomic_fetch_add(&plugin.colls, 1);
}

static void *start_proxy_op(struct context *ctx, int peer, int is_send) {
    struct proxy_op *op = calloc(1, sizeof(*op));
    if (!op)
        return NULL;
    op->type = EV_PROXY_OP;
    op->is_send = is_send;
    op->link = find_link(ctx, peer, is_send);
    return op;
}

static void *start_step(struct proxy_op *op, int step) {
    struct step *s = &op->steps[(unsigned)step % STEP_SLOTS];
    *s = (struct step){.type = EV_PROXY_STEP, .op = op, .state = 0, .since = now_ns()};
    return s;
}

// A step changed state: the time of the state it leaves is charged where it belongs.
static void step_state(struct step *s, int state, uint64_t trans_size) {
    uint64_t now = now_ns();
    struct link *l = s->op->link;
    if (l && s->state == ST_SEND_PEER_WAIT)
        atomic_fetch_add(&l->peer_wait_ns, now - s->since);
    else if (l && s->state == ST_RECV_WAIT)
        atomic_fetch_add(&l->wire_ns, now - s->since);
    if (trans_size > s->trans_size)
        s->trans_size = trans_size;
    s->state = state;
    s->since = now;
}

static void stop_step(struct step *s) {
    struct link *l = s->op->link;
    if (!l)
        return;
    if (s->state == ST_SEND_WAIT || s->state == ST_RECV_WAIT)
        atomic_fetch_add(&l->wire_ns, now_ns() - s->since);
    atomic_fetch_add(&l->bytes, s->trans_size);
    atomic_fetch_add(&l->steps, 1);
}

// Every version's startEvent, once its descriptor's header is read.
static nccl_result_t start_event(struct context *ctx, void **handle, uint64_t type, void *parent,
                                 const nccl_event_body_t *d) {
    *handle = NULL;
    switch (type) {
    case EV_GROUP:
        *handle = (void *)&group_event;
        break;
    case EV_COLL:
        *handle = start_task(ctx, d->coll.func, d->coll.datatype, d->coll.count, d->coll.n_channels, d->coll.seq);
        break;
    case EV_P2P:
        *handle = start_task(ctx, d->p2p.func, d->p2p.datatype, d->p2p.count, d->p2p.n_channels, 0);
        break;
    case EV_KERNEL_CH:
        if (parent && *(const uint8_t *)parent == EV_COLL)
            *handle = start_kernel_ch(parent, d->kernel_ch.ptimer);
        break;
    case EV_PROXY_OP:
        // With PXN, this proxy thread also serves ops of another process of the node: their context and
        // parent are that process's pointers, not to be touched here. Its own plugin cannot see them either:
        // those transfers are not counted (NCCL's documented limit).
        if (d->proxy_op.pid == getpid())
            *handle = start_proxy_op(ctx, d->proxy_op.peer, d->proxy_op.is_send);
        break;
    case EV_PROXY_STEP:
        if (parent && *(const uint8_t *)parent == EV_PROXY_OP)
            *handle = start_step(parent, d->proxy_step.step);
        break;
    }
    return nccl_success;
}

static nccl_result_t record_event_state(void *handle, int state, nccl_event_state_args_t *args) {
    if (!handle)
        return nccl_success;
    switch (*(const uint8_t *)handle) {
    case EV_PROXY_STEP:
        step_state(handle, state, args ? args->proxy_step.trans_size : 0);
        break;
    case EV_KERNEL_CH:
        if (state == ST_KERNEL_CH_STOP && args)
            stop_kernel_ch(handle, args->kernel_ch.ptimer);
        break;
    }
    return nccl_success;
}

static nccl_result_t stop_event(void *handle) {
    if (!handle)
        return nccl_success;
    switch (*(const uint8_t *)handle) {
    case EV_KERNEL_CH:
    case EV_PROXY_OP:
        free(handle);
        break;
    case EV_PROXY_STEP:
        stop_step(handle);
        break;
    }  // groups and tasks live in static or per-communicator storage
    return nccl_success;
}

// Each version's entry points: the descriptor header and init's argument order are all that differ.
static nccl_result_t init_v4(void **context, int *mask, const char *comm_name, uint64_t comm_hash, int n_nodes,
                             int nranks, int rank, nccl_logger_t log) {
    (void)comm_name; (void)n_nodes; (void)log;
    return init(context, mask, comm_hash, rank, nranks);
}

static nccl_result_t init_v5(void **context, uint64_t comm_id, int *mask, const char *comm_name, int n_nodes,
                             int nranks, int rank, nccl_logger_t log) {
    (void)comm_name; (void)n_nodes; (void)log;
    return init(context, mask, comm_id, rank, nranks);
}

static nccl_result_t start_event_v4(void *context, void **handle, nccl_event_descr_v4_t *d) {
    return start_event(context, handle, d->type, d->parent, &d->body);
}

static nccl_result_t start_event_v5(void *context, void **handle, nccl_event_descr_v5_t *d) {
    return start_event(context, handle, d->type, d->parent, &d->body);
}

SHIM_API const nccl_profiler_v4_t ncclProfiler_v4 = {
    .name = "rankscope", .init = init_v4, .start_event = start_event_v4, .stop_event = stop_event,
    .record_event_state = record_event_state, .finalize = finalize,
};

#define PROFILER_V5 {.name = "rankscope", .init = init_v5, .start_event = start_event_v5, .stop_event = stop_event, \
                     .record_event_state = record_event_state, .finalize = finalize}
SHIM_API const nccl_profiler_v5_t ncclProfiler_v5 = PROFILER_V5;
// v6 and v7 add events the plugin leaves off in its mask (copy-engine collectives, kernel phases): to it, they
// are v5. Collectives NCCL runs on copy engines are therefore not timed.
SHIM_API const nccl_profiler_v5_t ncclProfiler_v6 = PROFILER_V5;
SHIM_API const nccl_profiler_v5_t ncclProfiler_v7 = PROFILER_V5;

// Counters a test (or a debugger) reads.
struct rankscope_nccl_stats {
    uint64_t colls;          // task spans handed to rankscope:nccl_coll
    uint64_t links_emitted;  // link sums handed to rankscope:nccl_link
    uint64_t links_dropped;  // proxy ops whose (peer, direction) found no free link slot
};

SHIM_API void rankscope_nccl_stats(struct rankscope_nccl_stats *out) {
    out->colls = atomic_load(&plugin.colls);
    out->links_emitted = atomic_load(&plugin.links_emitted);
    out->links_dropped = atomic_load(&plugin.links_dropped);
}
