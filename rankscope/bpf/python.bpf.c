// CPython frame sampler: where each thread of a watched Python process spends its wall time, per stack of
// code objects.
//
// On CPU: on every tick of a software CPU clock (py_sample, a perf-event program), if the interrupted task
// belongs to a watched process, find that thread's Python thread state and count its stack.
// Off CPU: on every context switch (the sched_switch tracepoint, attached when the object loads), a thread
// of a watched process that goes to sleep (not one that is preempted) has its stack walked the same way and
// remembered with the time, per thread id, in py_sleeping; when that thread is switched in again, the time
// it was away is added to its stack's nanoseconds. A thread still asleep when user space reads is flushed
// (py_flush, run by user space through BPF_PROG_TEST_RUN): its time so far is added and its start moved to
// now, so a thread blocked for good still shows, window after window.
//
// Loaded as its own BPF object, one per interpreter layout: the offsets come in as -D macros that
// rankscope.agent.interpreters.cpython derives from the target (a table checked against the live
// process, or, from 3.13, the interpreter's own _Py_DebugOffsets).  Names are not read here: the stack
// is a fixed array of code-object addresses and user space resolves them from /proc/PID/mem.
//
// Required macros (byte offsets unless said otherwise):
//   PY_RUNTIME_INTERP_HEAD   _PyRuntime.interpreters.head
//   PY_INTERP_NEXT           PyInterpreterState.next
//   PY_INTERP_TSTATE_HEAD    PyInterpreterState.threads.head (3.10: tstate_head)
//   PY_TSTATE_NEXT           PyThreadState.next
//   PY_TSTATE_THREAD_ID      PyThreadState.native_thread_id (3.11+: gettid() in the target's pid namespace,
//                            compared with bpf_get_ns_current_pid_tgid), or, with PY_MATCH_PTHREAD (3.10),
//                            PyThreadState.thread_id (pthread_self(), compared with the thread's TLS base,
//                            read at PY_TASK_FSBASE in the kernel's task_struct: thread.fsbase, from BTF)
//   PY_TSTATE_FRAME          the thread state's frame pointer (3.10 frame, 3.11/3.12 cframe, 3.13+ current_frame)
//   PY_CFRAME_CURRENT_FRAME  if defined: PY_TSTATE_FRAME points to a _PyCFrame; this is its current_frame
//   PY_FRAME_PREVIOUS        the frame's link to its caller (f_back / previous)
//   PY_FRAME_CODE            the frame's code object (f_code / f_executable)
//   PY_FRAME_OWNER           if defined: the frame's owner byte; frames with owner >= PY_OWNER_SKIP_FROM
//                            (C-stack shims, interpreter-owned base frames) are skipped
//   PY_CODE_TAG_MASK         low bits to clear from the code pointer (3.14 tagged stack references)
//   PY_MAX_DEPTH             code objects kept per stack (innermost first)
#include <uapi/linux/ptrace.h>
#include <uapi/linux/bpf_perf_event.h>

#ifndef PY_MAX_DEPTH
#define PY_MAX_DEPTH 48
#endif
#ifndef PY_MAX_TSTATES
#define PY_MAX_TSTATES 256  // thread states (over all interpreters) searched for the current thread
#endif
#ifndef PY_OWNER_SKIP_FROM
#define PY_OWNER_SKIP_FROM 3
#endif
#ifndef PY_CODE_TAG_MASK
#define PY_CODE_TAG_MASK 0
#endif
#ifndef PY_MAX_SLEEPING
#define PY_MAX_SLEEPING 8192  // threads of watched processes off CPU at once (of one layout)
#endif
#define PY_FRAME_STEPS (PY_MAX_DEPTH + 32)  // frames visited, shims included
#define TRACE_PAGES 128  // 512 KiB: ~1,100 samples (~460 bytes each) between two reads of a capture
#include "trace.h"

// A thread state's id and link, and a frame's code, link and owner, are each read with one
// bpf_probe_read_user of the bytes that span them: a read costs about the same for 8 bytes as for 200.
#define PY_MAX2(a, b) ((a) > (b) ? (a) : (b))
#define PY_TSTATE_SPAN (PY_MAX2(PY_MAX2(PY_TSTATE_NEXT, PY_TSTATE_THREAD_ID), PY_TSTATE_FRAME) + 8)
#ifdef PY_FRAME_OWNER
#define PY_FRAME_SPAN PY_MAX2(PY_MAX2(PY_FRAME_PREVIOUS, PY_FRAME_CODE) + 8, PY_FRAME_OWNER + 1)
#else
#define PY_FRAME_SPAN (PY_MAX2(PY_FRAME_PREVIOUS, PY_FRAME_CODE) + 8)
#endif
#ifndef PY_NO_TSTATE_RECHECK_NS
#define PY_NO_TSTATE_RECHECK_NS 250000000ULL  // how long a thread found without a thread state keeps none
#endif
#define PY_FLUSH_BATCH 12  // thread ids per py_flush run: a raw tracepoint context holds 12 u64

// sched_switch's prev_state: TASK_REPORT_MAX when the task was preempted (still runnable), else the bit of
// its reported state: 0 running (a yield), 0x10 EXIT_DEAD / 0x20 EXIT_ZOMBIE for a thread that is exiting.
#define PY_TASK_REPORT_MAX 0x100
#define PY_TASK_EXITING 0x30

_Static_assert(PY_TSTATE_NEXT % 8 == 0 && PY_TSTATE_THREAD_ID % 8 == 0 && PY_TSTATE_FRAME % 8 == 0,
               "thread state fields are 8-aligned");
_Static_assert(PY_FRAME_PREVIOUS % 8 == 0 && PY_FRAME_CODE % 8 == 0, "frame fields are 8-aligned");

// What a walk found (the `kind` of its stack key).
#define PY_KIND_FRAMES 0      // a stack of code objects
#define PY_KIND_NO_TSTATE 1   // the thread has no Python thread state (a native thread)
#define PY_KIND_NO_FRAME 2    // a Python thread running no Python frame
#define PY_KIND_UNREADABLE 3  // the interpreter's memory could not be read (or the namespace did not match)
// Flags on PY_KIND_FRAMES.
#define PY_FLAG_TRUNCATED 1   // more frames than PY_MAX_DEPTH: the outermost ones are missing
#define PY_FLAG_PARTIAL 2     // a frame link could not be read: the outer part is missing

struct py_proc {
    u64 runtime;  // address of _PyRuntime in the target
    u64 ns_dev;   // the target's pid namespace (kernel dev_t of nsfs and inode), for native_thread_id
    u64 ns_ino;
};
BPF_HASH(py_watched, u32, struct py_proc, 1024);

struct py_stack {
    u32 pid;
    u16 kind;
    u16 flags;
    u32 depth;               // code objects in code[]
    u32 pad;
    u64 code[PY_MAX_DEPTH];  // innermost first, zero after the last
};

// A thread of a watched process that is off CPU: since when (bpf_ktime_get_ns), in which stack.
// ts is claimed atomically: exchanged for 0 by the wake-up, compared-and-swapped to now by a flush.
struct py_sleep {
    u64 ts;
    struct py_stack stack;
};

// Two generations of on-CPU sample counts and of off-CPU nanoseconds: the programs add to the one py_ctl
// names; user space flips it, then drains the other, so a read never races with the counting it reads.
BPF_HASH(py_stacks_0, struct py_stack, u64, 8192);
BPF_HASH(py_stacks_1, struct py_stack, u64, 8192);
BPF_HASH(py_offcpu_0, struct py_stack, u64, 8192);
BPF_HASH(py_offcpu_1, struct py_stack, u64, 8192);
BPF_ARRAY(py_ctl, u32, 1);
// Thread id (the kernel's, as in sched_switch) -> the sleep in progress. A plain hash, not an LRU one: an
// LRU map can recycle entries long before it is full (each CPU reserves free ones, 128 before kernel 6.16),
// which would lose a thread blocked for good.
// Every entry is deleted when its thread runs again; entries of a detached process are deleted by user
// space, and never counted (the wake-up checks py_watched).
BPF_HASH(py_sleeping, u32, struct py_sleep, PY_MAX_SLEEPING);
// Per-CPU scratch for a stack being walked: slot 0 for py_sample, slot 1 for the sched_switch program.
BPF_PERCPU_ARRAY(py_scratch, struct py_sleep, 2);

// Thread id -> its thread state as last found, verified at each use (its id must still be the thread's),
// so that a walk does not search the thread list each time; or 0: none found, at `at`. A switch-out then
// does not search again for PY_NO_TSTATE_RECHECK_NS (native threads of a process, OpenMP's or NCCL's, sleep
// often: the search would be all they cost); a CPU sample always does, as before.
struct py_tcache {
    u64 tstate;
    u64 at;
};
BPF_TABLE("lru_hash", u32, struct py_tcache, py_tstates, 16384);

// Global counters: 0 samples of watched processes, 1 samples dropped (stack map full), 2 thread not found
// within PY_MAX_TSTATES although the walk did not end, 3 sleeps of watched threads (switch-outs walked),
// 4 off-CPU time lost (py_sleeping or an off-CPU map full).
BPF_PERCPU_ARRAY(py_counters, u64, 5);

static __always_inline void py_count(u32 i) {
    u64 *c = py_counters.lookup(&i);
    if (c)
        (*c)++;
}

static __always_inline u64 py_read_ptr(u64 addr) {
    u64 v = 0;
    if (bpf_probe_read_user(&v, sizeof(v), (void *)addr))
        return 0;
    return v;
}

// The thread state whose id equals `want`, or 0.  Walks every interpreter's thread list. `hdr` is left
// holding the PY_TSTATE_SPAN bytes of the one found.
static __always_inline u64 py_find_tstate(u64 runtime, u64 want, u64 *hdr, int *unreadable) {
    u64 interp = 0, ts = 0;
    if (bpf_probe_read_user(&interp, sizeof(interp), (void *)(runtime + PY_RUNTIME_INTERP_HEAD)) || !interp) {
        *unreadable = 1;
        return 0;
    }
    ts = py_read_ptr(interp + PY_INTERP_TSTATE_HEAD);
#pragma clang loop unroll(disable)
    for (int i = 0; i < PY_MAX_TSTATES; i++) {
        if (!ts) {
            interp = py_read_ptr(interp + PY_INTERP_NEXT);
            if (!interp)
                return 0;
            ts = py_read_ptr(interp + PY_INTERP_TSTATE_HEAD);
            continue;
        }
        if (bpf_probe_read_user(hdr, PY_TSTATE_SPAN, (void *)ts)) {
            ts = 0;  // as the end of this interpreter's list
            continue;
        }
        if (hdr[PY_TSTATE_THREAD_ID / 8] == want)
            return ts;
        ts = hdr[PY_TSTATE_NEXT / 8];
    }
    py_count(2);
    return 0;
}

// Fills `st` (zeroed, pid set) with the Python stack of the current thread, of process `proc`. With
// `trust_none`, a thread recently found without a thread state is taken to have none still.
static __always_inline void py_walk(struct py_proc *proc, struct py_stack *st, int trust_none) {
    // Which thread this is, in the terms the interpreter recorded.
#ifdef PY_MATCH_PTHREAD
    // x86-64: the TLS base is pthread_self(). Its offset in task_struct comes from the running kernel's
    // BTF, not from the headers bcc compiles with (they may be another kernel's). At a switch-out the
    // field holds the value saved when the thread last left a CPU (or set at clone): glibc never moves it.
    u64 want = 0;
    bpf_probe_read_kernel(&want, sizeof(want), (void *)(bpf_get_current_task() + PY_TASK_FSBASE));
#else
    struct bpf_pidns_info ns = {};
    if (bpf_get_ns_current_pid_tgid(proc->ns_dev, proc->ns_ino, &ns, sizeof(ns))) {
        st->kind = PY_KIND_UNREADABLE;
        return;
    }
    u64 want = ns.pid;  // the thread id in the target's pid namespace, as gettid() told the interpreter
#endif

    u32 tid = bpf_get_current_pid_tgid();
    u64 hdr_ts[(PY_TSTATE_SPAN + 7) / 8];
    u64 ts = 0;
    struct py_tcache *cached = py_tstates.lookup(&tid);
    if (cached) {
        u64 c = cached->tstate;
        if (c) {
            if (!bpf_probe_read_user(hdr_ts, PY_TSTATE_SPAN, (void *)c) && hdr_ts[PY_TSTATE_THREAD_ID / 8] == want)
                ts = c;
        } else if (trust_none && bpf_ktime_get_ns() - cached->at < PY_NO_TSTATE_RECHECK_NS) {
            st->kind = PY_KIND_NO_TSTATE;
            return;
        }
    }
    if (!ts) {
        int unreadable = 0;
        ts = py_find_tstate(proc->runtime, want, hdr_ts, &unreadable);
        if (unreadable) {
            st->kind = PY_KIND_UNREADABLE;
            return;
        }
        struct py_tcache found = {.tstate = ts, .at = bpf_ktime_get_ns()};
        py_tstates.update(&tid, &found);
        if (!ts) {
            st->kind = PY_KIND_NO_TSTATE;
            return;
        }
    }

    u64 frame = hdr_ts[PY_TSTATE_FRAME / 8];
#ifdef PY_CFRAME_CURRENT_FRAME
    if (frame)
        frame = py_read_ptr(frame + PY_CFRAME_CURRENT_FRAME);
#endif

    // The depth lives in map memory, not in a register: the verifier then sees an unknown value each
    // time, instead of a precise counter that would make every iteration's states distinct.
#pragma clang loop unroll(disable)
    for (int i = 0; i < PY_FRAME_STEPS; i++) {
        if (!frame)
            break;
        u64 hdr[(PY_FRAME_SPAN + 7) / 8];
        if (bpf_probe_read_user(hdr, PY_FRAME_SPAN, (void *)frame)) {
            st->flags |= PY_FLAG_PARTIAL;
            break;
        }
#ifdef PY_FRAME_OWNER
        if (((u8 *)hdr)[PY_FRAME_OWNER] < PY_OWNER_SKIP_FROM) {
#endif
            u64 code = hdr[PY_FRAME_CODE / 8] & ~((u64)PY_CODE_TAG_MASK);
            if (code) {
                u32 n = *(volatile u32 *)&st->depth;
                if (n >= PY_MAX_DEPTH) {
                    st->flags |= PY_FLAG_TRUNCATED;
                    break;
                }
                st->code[n] = code;
                *(volatile u32 *)&st->depth = n + 1;
            }
#ifdef PY_FRAME_OWNER
        }
#endif
        frame = hdr[PY_FRAME_PREVIOUS / 8];
    }
    if (frame && !st->flags)
        st->flags |= PY_FLAG_TRUNCATED;  // ran out of steps (a long run of skipped frames)
    st->kind = st->depth ? PY_KIND_FRAMES : PY_KIND_NO_FRAME;
}

// The current thread's stack, walked into scratch slot `slot`; NULL if the scratch is missing.
static __always_inline struct py_sleep *py_current_stack(struct py_proc *proc, u32 pid, u32 slot, int trust_none) {
    struct py_sleep *sc = py_scratch.lookup(&slot);
    if (!sc)
        return 0;
    // In pieces, kept apart by compiler barriers: clang turns a memset of more than 1 KiB (max_depth 127) into
    // a call, which BPF does not have, and would merge adjacent ones back into one.
    __builtin_memset(sc, 0, offsetof(struct py_sleep, stack.code));
    asm volatile("" ::: "memory");
    __builtin_memset(sc->stack.code, 0, PY_MAX_DEPTH / 2 * sizeof(u64));
    asm volatile("" ::: "memory");
    __builtin_memset(sc->stack.code + PY_MAX_DEPTH / 2, 0, (PY_MAX_DEPTH - PY_MAX_DEPTH / 2) * sizeof(u64));
    sc->stack.pid = pid;
    py_walk(proc, &sc->stack, trust_none);
    return sc;
}

static __always_inline int py_gen(void) {
    u32 zero = 0;
    u32 *gen = py_ctl.lookup(&zero);
    return gen && *gen;
}

static __always_inline void py_add_sample(struct py_stack *st) {
    u64 init = 0, *n;
    if (py_gen())
        n = py_stacks_1.lookup_or_try_init(st, &init);
    else
        n = py_stacks_0.lookup_or_try_init(st, &init);
    if (n)
        __sync_fetch_and_add(n, 1);
    else
        py_count(1);
}

static __always_inline void py_add_offcpu(struct py_stack *st, u64 ns) {
    u64 init = 0, *n;
    if (py_gen())
        n = py_offcpu_1.lookup_or_try_init(st, &init);
    else
        n = py_offcpu_0.lookup_or_try_init(st, &init);
    if (n)
        __sync_fetch_and_add(n, ns);
    else
        py_count(4);
}

// A trace capture's sample: the event, then the stack (user space interns it).
struct py_trace_sample {
    struct trace_rec rec;
    struct py_stack stack;
};

static __always_inline void py_trace_sample(u64 id, struct py_stack *st) {
    struct py_trace_sample *out = trace_events.ringbuf_reserve(sizeof(struct py_trace_sample));
    if (!out) {
        trace_count_lost();
        return;
    }
    u64 now = bpf_ktime_get_ns();
    out->rec = (struct trace_rec){.kind = TRACE_PY_SAMPLE, .pid = id >> 32, .tid = (u32)id, .start_ns = now,
                                  .end_ns = now};
    bpf_probe_read_kernel(&out->stack, sizeof(out->stack), st);
    trace_events.ringbuf_submit(out, 0);
}

int py_sample(struct bpf_perf_event_data *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    u32 pid = id >> 32;
    struct py_proc *proc = py_watched.lookup(&pid);
    if (!proc)
        return 0;
    py_count(0);
    struct py_sleep *sc = py_current_stack(proc, pid, 0, 0);
    if (!sc)
        return 0;
    py_add_sample(&sc->stack);
    if (tracing(pid))
        py_trace_sample(id, &sc->stack);
    return 0;
}

// Every context switch. An unwatched switch costs a lookup of the incoming thread in py_sleeping and, if
// the outgoing one goes to sleep, a lookup of its process in py_watched.
TRACEPOINT_PROBE(sched, sched_switch) {
    u32 next = args->next_pid;
    if (next) {  // 0: the idle task
        struct py_sleep *s = py_sleeping.lookup(&next);
        if (s) {
            u64 now = bpf_ktime_get_ns();
            u64 since = __sync_lock_test_and_set(&s->ts, 0);  // claimed: a flush now leaves it alone
            if (since && since < now && py_watched.lookup(&s->stack.pid))
                py_add_offcpu(&s->stack, now - since);
            py_sleeping.delete(&next);
        }
    }

    long state = args->prev_state;
    if (!state || (state & (PY_TASK_REPORT_MAX | PY_TASK_EXITING)))
        return 0;  // preempted (waits for a CPU, not for something), yielding, or exiting
    u64 id = bpf_get_current_pid_tgid();  // current is still the outgoing task
    u32 pid = id >> 32, tid = id;
    struct py_proc *proc = py_watched.lookup(&pid);
    if (!proc)
        return 0;
    py_count(3);
    struct py_sleep *sc = py_current_stack(proc, pid, 1, 1);
    if (!sc)
        return 0;
    sc->ts = bpf_ktime_get_ns();
    if (py_sleeping.update(&tid, sc))
        py_count(4);
    return 0;
}

// Run by user space (BPF_PROG_TEST_RUN, context: up to PY_FLUSH_BATCH thread ids, 0 after the last) at
// each read: the time so far of each of those threads still asleep is added to its stack, and its sleep
// now counts from now. A compare-and-swap on ts: a wake-up that claimed it first wins.
static __always_inline void py_flush_one(u32 tid, u64 now) {
    if (!tid)
        return;
    struct py_sleep *s = py_sleeping.lookup(&tid);
    if (!s)
        return;
    u64 since = *(volatile u64 *)&s->ts;
    if (!since || since >= now || !py_watched.lookup(&s->stack.pid))
        return;
    if (__sync_val_compare_and_swap(&s->ts, since, now) == since)
        py_add_offcpu(&s->stack, now - since);
}

int py_flush(struct bpf_raw_tracepoint_args *ctx) {
    u64 now = bpf_ktime_get_ns();
    // Constant indices: the verifier allows no variable offset into a context.
    py_flush_one(ctx->args[0], now);
    py_flush_one(ctx->args[1], now);
    py_flush_one(ctx->args[2], now);
    py_flush_one(ctx->args[3], now);
    py_flush_one(ctx->args[4], now);
    py_flush_one(ctx->args[5], now);
    py_flush_one(ctx->args[6], now);
    py_flush_one(ctx->args[7], now);
    py_flush_one(ctx->args[8], now);
    py_flush_one(ctx->args[9], now);
    py_flush_one(ctx->args[10], now);
    py_flush_one(ctx->args[11], now);
    return 0;
}
