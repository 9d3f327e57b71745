// Shared by every probe kind: which processes are watched, per-function time accounting, and the
// collective bookkeeping that lets a later sync complete an asynchronous collective.
// Everything is aggregated here in the kernel; user space reads the maps once a window (a trace capture
// aside: its per-call events stream while it runs).
#ifndef RANKSCOPE_COMMON_H
#define RANKSCOPE_COMMON_H
#include <uapi/linux/ptrace.h>

#include "histogram.h"
#include "trace.h"

#define RING_SLOTS 64   // last collectives kept per process, for completing asynchronous ones
#define DONE_PAGES 1024 // completed-collective stream: 4 MiB, ~87k records between two reads

// Per-process state; a process is accounted only while user space keeps it in this map.
struct proc_state {
    u64 coll_seq;       // collectives seen so far
    u64 pending_first;  // oldest collective enqueued but not yet seen complete (0: none)
    u64 pending_last;
};
BPF_HASH(watched, u32, struct proc_state, 1024);

struct fn_key {
    u32 pid;
    u32 fn;
};
struct fn_val {
    u64 count;
    u64 total_ns;
    u64 max_ns;
    u64 bytes;
    u64 hist[HIST_SLOTS];
};
BPF_HASH(fn_stats, struct fn_key, struct fn_val, 16384);

// Calls in flight, per thread and function (entry timestamp and decoded payload).
struct call_key {
    u32 tid;
    u32 fn;
};
struct call_val {
    u64 ts;
    u64 bytes;
};
BPF_HASH(inflight, struct call_key, struct call_val, 16384);

// The last RING_SLOTS collectives of each process, so ranks can be lined up instance by instance.
struct ring_key {
    u32 pid;
    u32 slot;
};
struct coll_rec {
    u64 seq;
    u64 enter_ns;
    u64 done_ns;  // 0 until the host has seen it complete
    u64 bytes;
    u32 fn;
    u32 pad;
};
BPF_HASH(coll_ring, struct ring_key, struct coll_rec, 65536);

// Every completed collective, streamed to user space: the ring above keeps too few to line ranks up over a
// whole window (a pipeline stage makes ~20 collectives a step). Records that find the stream full are
// counted in done_lost, not silently dropped.
struct coll_done_rec {
    u32 pid;
    u32 fn;
    u64 seq;
    u64 enter_ns;
    u64 done_ns;
    u64 bytes;
};
BPF_RINGBUF_OUTPUT(coll_done, DONE_PAGES);
BPF_ARRAY(done_lost, u64, 1);

static __always_inline void emit_done(u32 pid, const struct coll_rec *rec) {
    trace_here(TRACE_COLLECTIVE, rec->fn, rec->enter_ns, rec->done_ns, rec->bytes, rec->seq);
    struct coll_done_rec out = {.pid = pid, .fn = rec->fn, .seq = rec->seq, .enter_ns = rec->enter_ns,
                                .done_ns = rec->done_ns, .bytes = rec->bytes};
    if (coll_done.ringbuf_output(&out, sizeof(out), 0)) {
        int zero = 0;
        u64 *lost = done_lost.lookup(&zero);
        if (lost)
            __sync_fetch_and_add(lost, 1);
    }
}

static __always_inline struct proc_state *watched_proc(void) {
    u32 pid = bpf_get_current_pid_tgid() >> 32;
    return watched.lookup(&pid);
}

static __always_inline struct fn_val *stats_for(u32 fn) {
    struct fn_key key = {.pid = bpf_get_current_pid_tgid() >> 32, .fn = fn};
    struct fn_val zero = {};
    return fn_stats.lookup_or_try_init(&key, &zero);
}

static __always_inline void add_latency(struct fn_val *v, u64 ns) {
    __sync_fetch_and_add(&v->total_ns, ns);
    __sync_fetch_and_add(&v->hist[hist_slot(ns)], 1);
    if (ns > v->max_ns)
        v->max_ns = ns;  // racy max is fine: a window's max, not a ledger
}

// Count a call without timing it: for hot, cheap calls (kernel launches) a uretprobe would cost more
// than the call itself.
static __always_inline int count_call(u32 fn, u64 bytes) {
    if (!watched_proc())
        return 0;
    struct fn_val *v = stats_for(fn);
    if (v) {
        __sync_fetch_and_add(&v->count, 1);
        __sync_fetch_and_add(&v->bytes, bytes);
    }
    u64 id = bpf_get_current_pid_tgid();
    if (tracing(id >> 32)) {  // the clock read only while a capture runs: this is the launch path
        u64 now = bpf_ktime_get_ns();
        trace_emit(TRACE_INSTANT, id >> 32, (u32)id, fn, now, now, bytes, 0);
    }
    return 0;
}

static __always_inline int timed_enter(u32 fn, u64 bytes) {
    if (!watched_proc())
        return 0;
    struct call_key key = {.tid = (u32)bpf_get_current_pid_tgid(), .fn = fn};
    struct call_val val = {.ts = bpf_ktime_get_ns(), .bytes = bytes};
    inflight.update(&key, &val);
    return 0;
}

// Ends a timed call: returns its duration (0 if its entry was not seen) and its entry record.
static __always_inline u64 timed_exit(u32 fn, struct call_val *out) {
    struct call_key key = {.tid = (u32)bpf_get_current_pid_tgid(), .fn = fn};
    struct call_val *val = inflight.lookup(&key);
    if (!val)
        return 0;
    *out = *val;
    inflight.delete(&key);
    return bpf_ktime_get_ns() - out->ts;
}

static __always_inline int timed_return(u32 fn) {
    struct call_val call = {};
    u64 ns = timed_exit(fn, &call);
    if (!ns)
        return 0;
    trace_here(TRACE_CALL, fn, call.ts, call.ts + ns, call.bytes, 0);
    struct fn_val *v = stats_for(fn);
    if (v) {
        __sync_fetch_and_add(&v->count, 1);
        __sync_fetch_and_add(&v->bytes, call.bytes);
        add_latency(v, ns);
    }
    return 0;
}

// A collective call returned. Asynchronous (NCCL) ones only enqueued work: they stay pending until a
// later host sync; blocking ones (gloo) are complete now.
static __always_inline int collective_return(u32 fn, bool blocking) {
    struct proc_state *p = watched_proc();
    if (!p)
        return 0;
    struct call_val call = {};
    u64 ns = timed_exit(fn, &call);
    if (!ns)
        return 0;
    u64 now = call.ts + ns;
    u64 seq = __sync_fetch_and_add(&p->coll_seq, 1) + 1;
    struct ring_key rk = {.pid = bpf_get_current_pid_tgid() >> 32, .slot = seq % RING_SLOTS};
    struct coll_rec rec = {.seq = seq, .enter_ns = call.ts, .done_ns = blocking ? now : 0,
                           .bytes = call.bytes, .fn = fn};
    coll_ring.update(&rk, &rec);
    trace_here(TRACE_CALL, fn, call.ts, now, call.bytes, seq);
    if (blocking)
        emit_done(rk.pid, &rec);
    struct fn_val *v = stats_for(fn);
    if (!v)
        return 0;
    __sync_fetch_and_add(&v->count, 1);
    __sync_fetch_and_add(&v->bytes, call.bytes);
    if (blocking) {
        add_latency(v, ns);
    } else {
        __sync_fetch_and_add(&v->total_ns, ns);
        if (!p->pending_first)
            p->pending_first = seq;
        p->pending_last = seq;
    }
    return 0;
}

// A host sync returned. If collectives were pending, this sync is where the host waited for them:
// the wait is charged to the collective (time waiting for peers plus transfer), not to the sync. Every
// pending one completes here, up to the ring's RING_SLOTS: a step of DDP buckets or per-tensor all-reduces
// enqueues 10-100 before its one sync (completing only the last 8 left an H200 NCCL job's 14 a step at 8
// records, and its step read at half the job's). A bounded loop, not unrolled (the verifier walks it).
static __always_inline int sync_return(u32 fn) {
    struct proc_state *p = watched_proc();
    if (!p)
        return 0;
    u64 last = p->pending_last;
    u64 first = p->pending_first;
    if (!last)
        return timed_return(fn);
    struct call_val call = {};
    u64 ns = timed_exit(fn, &call);
    if (!ns)
        return 0;
    u64 now = call.ts + ns;
    trace_here(TRACE_CALL, fn, call.ts, now, 0, 0);
    p->pending_first = 0;
    p->pending_last = 0;
    u32 pid = bpf_get_current_pid_tgid() >> 32;
    u32 last_fn = 0;
    for (int i = 0; i < RING_SLOTS; i++) {
        u64 seq = last - i;
        if (seq < first || seq == 0)
            break;
        struct ring_key rk = {.pid = pid, .slot = seq % RING_SLOTS};
        struct coll_rec *rec = coll_ring.lookup(&rk);
        if (!rec || rec->seq != seq || rec->done_ns)
            continue;
        rec->done_ns = now;
        emit_done(pid, rec);
        struct fn_val *v = stats_for(rec->fn);
        if (!v)
            continue;
        if (i == 0)
            __sync_fetch_and_add(&v->total_ns, ns);
        u64 lat = now - rec->enter_ns;
        __sync_fetch_and_add(&v->hist[hist_slot(lat)], 1);
        if (lat > v->max_ns)
            v->max_ns = lat;
    }
    return 0;
}

struct thread_key {
    u32 pid;
    u32 tid;
};

// Layered APIs (the CUDA runtime calls the driver, both probed): the upper layer's call in flight on each
// thread. A lower-layer call made inside it is part of it and is not accounted a second time. An upper
// call whose return was missed (attached mid-call) leaves its mark until the thread's next upper call.
BPF_HASH(upper_call, struct thread_key, u32, 16384);  // -> fn of the upper layer's call

static __always_inline struct thread_key this_thread(void) {
    u64 id = bpf_get_current_pid_tgid();
    struct thread_key key = {.pid = id >> 32, .tid = (u32)id};
    return key;
}

static __always_inline int upper_enter(u32 fn, u64 bytes) {
    if (!watched_proc())
        return 0;
    struct thread_key key = this_thread();
    upper_call.update(&key, &fn);
    return timed_enter(fn, bytes);
}

static __always_inline void upper_exit(u32 fn) {
    struct thread_key key = this_thread();
    u32 *cur = upper_call.lookup(&key);
    if (cur && *cur == fn)
        upper_call.delete(&key);
}

static __always_inline int lower_enter(u32 fn, u64 bytes) {
    if (!watched_proc())
        return 0;
    struct thread_key key = this_thread();
    if (upper_call.lookup(&key))
        return 0;  // its return then finds no entry and accounts nothing
    return timed_enter(fn, bytes);
}

// Probe entry points, one per handler shape (a macro and its arguments), shared by every symbol of that
// shape: the loader attaches each symbol with its function id as the BPF cookie, so the kernel's verifier
// checks a handful of programs, not one per symbol. A kind's lines using them are generated from its
// declarations (agent/sources/probes/<kind>.py: Probe.handler), not written here.
#define FN_COOKIE ((u32)bpf_get_attach_cookie(ctx))
#define COUNTED(shape, bytes_expr)                                        \
    int enter_##shape(struct pt_regs *ctx) { return count_call(FN_COOKIE, (bytes_expr)); }
#define TIMED(shape, bytes_expr)                                          \
    int enter_##shape(struct pt_regs *ctx) { return timed_enter(FN_COOKIE, (bytes_expr)); } \
    int return_##shape(struct pt_regs *ctx) { return timed_return(FN_COOKIE); }
// Timed and sync probes of the two layers of an API: UPPER_* mark the thread while they run, LOWER_* skip
// inside them.
#define UPPER_TIMED(shape, bytes_expr)                                    \
    int enter_##shape(struct pt_regs *ctx) { return upper_enter(FN_COOKIE, (bytes_expr)); } \
    int return_##shape(struct pt_regs *ctx) { u32 fn = FN_COOKIE; upper_exit(fn); return timed_return(fn); }
#define UPPER_SYNC(shape)                                                 \
    int enter_##shape(struct pt_regs *ctx) { return upper_enter(FN_COOKIE, 0); } \
    int return_##shape(struct pt_regs *ctx) { u32 fn = FN_COOKIE; upper_exit(fn); return sync_return(fn); }
#define LOWER_TIMED(shape, bytes_expr)                                    \
    int enter_##shape(struct pt_regs *ctx) { return lower_enter(FN_COOKIE, (bytes_expr)); } \
    int return_##shape(struct pt_regs *ctx) { return timed_return(FN_COOKIE); }
#define LOWER_SYNC(shape)                                                 \
    int enter_##shape(struct pt_regs *ctx) { return lower_enter(FN_COOKIE, 0); } \
    int return_##shape(struct pt_regs *ctx) { return sync_return(FN_COOKIE); }
#define COLLECTIVE(shape, bytes_expr, blocking)                           \
    int enter_##shape(struct pt_regs *ctx) { return timed_enter(FN_COOKIE, (bytes_expr)); } \
    int return_##shape(struct pt_regs *ctx) { return collective_return(FN_COOKIE, (blocking)); }

#endif
