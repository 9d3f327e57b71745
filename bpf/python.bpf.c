// CPython frame sampler: on every tick of a software CPU clock, if the interrupted task belongs to a
// watched Python process, find that thread's Python thread state and count its stack of code objects.
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
#define PY_FRAME_STEPS (PY_MAX_DEPTH + 32)  // frames visited, shims included

// What a sample found (the `kind` of its stack key).
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
// Two generations of counts: the program adds to the one py_ctl names; user space flips it, then drains
// the other, so a read never races with the counting it reads.
BPF_HASH(py_stacks_0, struct py_stack, u64, 8192);
BPF_HASH(py_stacks_1, struct py_stack, u64, 8192);
BPF_ARRAY(py_ctl, u32, 1);
BPF_PERCPU_ARRAY(py_scratch, struct py_stack, 1);

// Global counters: 0 samples of watched processes, 1 dropped (stack map full), 2 thread not found
// within PY_MAX_TSTATES although the walk did not end.
BPF_PERCPU_ARRAY(py_counters, u64, 4);

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

// The thread state whose id equals `want`, or 0.  Walks every interpreter's thread list.
static __always_inline u64 py_find_tstate(u64 runtime, u64 want, int *unreadable) {
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
        u64 id = 0;
        bpf_probe_read_user(&id, sizeof(id), (void *)(ts + PY_TSTATE_THREAD_ID));
        if (id == want)
            return ts;
        ts = py_read_ptr(ts + PY_TSTATE_NEXT);
    }
    py_count(2);
    return 0;
}

static __always_inline void py_add(struct py_stack *st) {
    u32 zero = 0;
    u32 *gen = py_ctl.lookup(&zero);
    u64 init = 0, *n;
    if (gen && *gen)
        n = py_stacks_1.lookup_or_try_init(st, &init);
    else
        n = py_stacks_0.lookup_or_try_init(st, &init);
    if (n)
        __sync_fetch_and_add(n, 1);
    else
        py_count(1);
}

int py_sample(struct bpf_perf_event_data *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    u32 pid = id >> 32;
    struct py_proc *proc = py_watched.lookup(&pid);
    if (!proc)
        return 0;
    u32 zero = 0;
    struct py_stack *st = py_scratch.lookup(&zero);
    if (!st)
        return 0;
    py_count(0);
    __builtin_memset(st, 0, sizeof(*st));
    st->pid = pid;

    // Which thread this is, in the terms the interpreter recorded.
#ifdef PY_MATCH_PTHREAD
    // x86-64: the TLS base is pthread_self(). Its offset in task_struct comes from the running kernel's
    // BTF, not from the headers bcc compiles with (they may be another kernel's).
    u64 want = 0;
    bpf_probe_read_kernel(&want, sizeof(want), (void *)(bpf_get_current_task() + PY_TASK_FSBASE));
#else
    struct bpf_pidns_info ns = {};
    if (bpf_get_ns_current_pid_tgid(proc->ns_dev, proc->ns_ino, &ns, sizeof(ns))) {
        st->kind = PY_KIND_UNREADABLE;
        py_add(st);
        return 0;
    }
    u64 want = ns.pid;  // the thread id in the target's pid namespace, as gettid() told the interpreter
#endif

    int unreadable = 0;
    u64 ts = py_find_tstate(proc->runtime, want, &unreadable);
    if (!ts) {
        st->kind = unreadable ? PY_KIND_UNREADABLE : PY_KIND_NO_TSTATE;
        py_add(st);
        return 0;
    }

    u64 frame = py_read_ptr(ts + PY_TSTATE_FRAME);
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
#ifdef PY_FRAME_OWNER
        u8 owner = 0;
        bpf_probe_read_user(&owner, sizeof(owner), (void *)(frame + PY_FRAME_OWNER));
        if (owner < PY_OWNER_SKIP_FROM) {
#endif
            u64 code = py_read_ptr(frame + PY_FRAME_CODE) & ~((u64)PY_CODE_TAG_MASK);
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
        u64 prev = 0;
        if (bpf_probe_read_user(&prev, sizeof(prev), (void *)(frame + PY_FRAME_PREVIOUS))) {
            st->flags |= PY_FLAG_PARTIAL;
            break;
        }
        frame = prev;
    }
    if (frame && !st->flags)
        st->flags |= PY_FLAG_TRUNCATED;  // ran out of steps (a long run of skipped frames)
    st->kind = st->depth ? PY_KIND_FRAMES : PY_KIND_NO_FRAME;
    py_add(st);
    return 0;
}
