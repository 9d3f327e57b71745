// Scheduler view of every watched process's threads, from tracepoints: time on CPU, time runnable but
// waiting for a CPU (run-queue delay), time asleep (voluntary) or blocked in uninterruptible waits (I/O),
// preemptions, and which tasks held the CPU while a watched thread waited for it.
#include "common.h"

#define TASK_INTERRUPTIBLE 0x1
#define TASK_UNINTERRUPTIBLE 0x2
#define TASK_REPORT_MAX 0x100  // sched_switch reports a preempted task's state as this (kernel >= 4.14)

// struct thread_key {pid, tid}: common.h
struct thread_val {
    u64 on_cpu_ns;
    u64 runq_ns;
    u64 sleep_ns;
    u64 io_ns;
    u64 preempted;  // involuntary switches
    u64 reclaim_ns;  // direct memory reclaim: the thread itself freeing memory before it can allocate
    u64 runq_hist[HIST_SLOTS];
};
BPF_HASH(thread_stats, struct thread_key, struct thread_val, 16384);

// tid -> pid of watched threads seen switching out, so a wakeup (which names only the tid) finds its process.
BPF_TABLE("lru_hash", u32, u32, sched_tids, 65536);

struct thread_state {
    u64 since;   // when the current state began
    u32 state;   // 0 on CPU, 1 runnable, 2 asleep, 3 blocked (I/O)
    u32 pad;
};
BPF_TABLE("lru_hash", u32, struct thread_state, thread_now, 65536);

// Tasks that held the CPU right before a watched thread got it back after waiting: the neighbours.
struct thief_key {
    u32 pid;          // the watched process that waited
    u32 thief_tgid;   // the task's process
};
struct thief_val {
    u64 waited_ns;
    u64 count;
    char comm[16];
};
BPF_HASH(thieves, struct thief_key, struct thief_val, 4096);

enum { ON_CPU = 0, RUNNABLE = 1, ASLEEP = 2, BLOCKED = 3 };

static __always_inline struct thread_val *thread_stats_for(u32 pid, u32 tid) {
    struct thread_key key = {.pid = pid, .tid = tid};
    struct thread_val zero = {};
    return thread_stats.lookup_or_try_init(&key, &zero);
}

// Closes the state the thread was in (`st`, its entry in thread_now) and charges its duration.
static __always_inline u64 close_state(struct thread_state *st, u32 pid, u32 tid, u64 now, u32 *was) {
    if (!st)
        return 0;
    u64 ns = now - st->since;
    *was = st->state;
    if (tid == pid)  // the main thread's states are a trace capture's scheduler track
        trace_emit(TRACE_SCHED, pid, tid, st->state, st->since, now, 0, 0);
    struct thread_val *v = thread_stats_for(pid, tid);
    if (!v)
        return ns;
    switch (st->state) {
    case ON_CPU: __sync_fetch_and_add(&v->on_cpu_ns, ns); break;
    case RUNNABLE: {
        __sync_fetch_and_add(&v->runq_ns, ns);
        __sync_fetch_and_add(&v->runq_hist[hist_slot(ns)], 1);
        break;
    }
    case ASLEEP: __sync_fetch_and_add(&v->sleep_ns, ns); break;
    default: __sync_fetch_and_add(&v->io_ns, ns); break;
    }
    return ns;
}

// Opens the thread's next state: in place when it has an entry (an LRU insert per switch would cost more
// than the rest of the accounting), else inserted. A thread's own switch and its wakeup are serialized by
// its run queue's lock, so the two fields are never read half-written.
static __always_inline void open_state(struct thread_state *st, u32 tid, u64 now, u32 state) {
    if (st) {
        st->since = now;
        st->state = state;
        return;
    }
    struct thread_state fresh = {.since = now, .state = state};
    thread_now.update(&tid, &fresh);
}

TRACEPOINT_PROBE(sched, sched_switch) {
    u64 now = 0;  // read only for watched threads: most switches on a node are not theirs
    u64 cur = bpf_get_current_pid_tgid();
    u32 prev_pid = cur >> 32;  // the task switching out is still current
    u32 prev_tid = args->prev_pid;
    if (prev_tid && watched.lookup(&prev_pid)) {
        u32 *known = sched_tids.lookup(&prev_tid);
        if (!known || *known != prev_pid)  // first seen, or a recycled tid
            sched_tids.update(&prev_tid, &prev_pid);
        struct thread_state *st = thread_now.lookup(&prev_tid);
        now = bpf_ktime_get_ns();
        u32 was;
        close_state(st, prev_pid, prev_tid, now, &was);
        long s = args->prev_state;
        u32 next_state = ASLEEP;
        if (s == 0 || (s & TASK_REPORT_MAX)) {
            next_state = RUNNABLE;
            struct thread_val *v = thread_stats_for(prev_pid, prev_tid);
            if (v)
                __sync_fetch_and_add(&v->preempted, 1);
        } else if (s & TASK_UNINTERRUPTIBLE) {
            next_state = BLOCKED;
        }
        open_state(st, prev_tid, now, next_state);
    }
    u32 next_tid = args->next_pid;
    u32 *next_pid = sched_tids.lookup(&next_tid);
    if (!next_tid || !next_pid || !watched.lookup(next_pid))
        return 0;
    u32 pid = *next_pid;
    u32 was = ON_CPU;
    struct thread_state *st = thread_now.lookup(&next_tid);
    if (!now)
        now = bpf_ktime_get_ns();
    u64 waited = close_state(st, pid, next_tid, now, &was);
    if (was == RUNNABLE && prev_tid && prev_pid != pid) {
        struct thief_key tk = {.pid = pid, .thief_tgid = prev_pid};
        struct thief_val zero = {};
        struct thief_val *t = thieves.lookup_or_try_init(&tk, &zero);
        if (t) {
            __sync_fetch_and_add(&t->waited_ns, waited);
            __sync_fetch_and_add(&t->count, 1);
            bpf_get_current_comm(&t->comm, sizeof(t->comm));
        }
    }
    open_state(st, next_tid, now, ON_CPU);
    return 0;
}

// A wakeup ends a sleep or a block; the thread is runnable until it is switched in.
static __always_inline int on_wakeup(u32 tid) {
    u32 *pid = sched_tids.lookup(&tid);
    if (!pid || !watched.lookup(pid))
        return 0;
    struct thread_state *st = thread_now.lookup(&tid);
    if (!st || st->state == ON_CPU || st->state == RUNNABLE)  // not asleep: nothing ends here
        return 0;
    u64 now = bpf_ktime_get_ns();
    u32 was;
    close_state(st, *pid, tid, now, &was);
    open_state(st, tid, now, RUNNABLE);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_wakeup) { return on_wakeup(args->pid); }
TRACEPOINT_PROBE(sched, sched_wakeup_new) { return on_wakeup(args->pid); }

// Direct reclaim runs in the allocating task's context: time it per watched thread. Raw tracepoints (their
// arguments are not read): removing one does not wait for a grace period under the kernel's event lock, as
// a perf-event tracepoint's removal does (~70 ms each at the end of every diagnose).
BPF_HASH(reclaim_start, u32, u64, 4096);

RAW_TRACEPOINT_PROBE(mm_vmscan_direct_reclaim_begin) {
    if (!watched_proc())
        return 0;
    u32 tid = bpf_get_current_pid_tgid();
    u64 now = bpf_ktime_get_ns();
    reclaim_start.update(&tid, &now);
    return 0;
}

RAW_TRACEPOINT_PROBE(mm_vmscan_direct_reclaim_end) {
    u64 cur = bpf_get_current_pid_tgid();
    u32 tid = cur;
    u64 *start = reclaim_start.lookup(&tid);
    if (!start)
        return 0;
    struct thread_val *v = thread_stats_for(cur >> 32, tid);
    if (v)
        __sync_fetch_and_add(&v->reclaim_ns, bpf_ktime_get_ns() - *start);
    reclaim_start.delete(&tid);
    return 0;
}
