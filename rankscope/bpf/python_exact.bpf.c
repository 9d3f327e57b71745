// Exact timing of chosen Python functions: a uprobe and a uretprobe on _PyEval_EvalFrameDefault, attached
// per watched process. The uprobe reads the code object of the frame being evaluated (its second argument)
// and decides once per code object, by its co_name, whether it is timed (cached in pyx_verdict; user space
// narrows the choice by qualified name and file and overrides verdicts). A timed entry pushes (stack
// pointer, time) on its thread's small stack; the uretprobe of any eval call first looks the thread up,
// and only the return whose stack pointer is the timed entry's + 8 (its return address popped) closes it.
// One program for every CPython version: the offsets come per process in pyx_targets.
#include <uapi/linux/ptrace.h>

#include "histogram.h"
#define TRACE_PAGES 128  // 512 KiB: ~11k timed calls between two reads of a capture
#include "trace.h"

#define PYX_NAMES 8        // co_names timed (forward, __next__, the user's)
#define PYX_NAME_WORDS 4   // 32 bytes of a name are compared; longer ones match by prefix and length
#define PYX_DEPTH 8        // timed calls nested on one thread

struct pyx_target {
    u32 frame_code;          // frame -> code object (f_code, f_executable)
    u32 code_name;           // code -> co_name
    u32 unicode_length;      // str -> length
    u32 unicode_ascii_size;  // str -> compact ASCII data
    u64 code_tag_mask;       // low bits of f_executable that are tags (3.14)
    u64 entries;             // eval entries probed: what the process pays for (user space bounds the rate)
};
BPF_HASH(pyx_targets, u32, struct pyx_target, 1024);

struct pyx_name {
    u64 len;
    u64 w[PYX_NAME_WORDS];
};
BPF_ARRAY(pyx_names, struct pyx_name, PYX_NAMES);  // len 0: unused slot

struct pyx_code_key {
    u32 pid;
    u32 pad;
    u64 code;
};
#define VERDICT_TIMED 1
#define VERDICT_SKIP 2
BPF_TABLE("lru_hash", struct pyx_code_key, u8, pyx_verdict, 65536);

struct pyx_val {
    u64 count;
    u64 total_ns;
    u64 max_ns;
    u64 hist[HIST_SLOTS];
};
BPF_HASH(pyx_stats, struct pyx_code_key, struct pyx_val, 4096);

struct pyx_active {
    u32 depth;
    u32 pid;
    u64 sp[PYX_DEPTH];
    u64 ts[PYX_DEPTH];
    u64 code[PYX_DEPTH];
};
BPF_TABLE("lru_hash", u32, struct pyx_active, pyx_active, 16384);

// 0: calls nested deeper than PYX_DEPTH (not timed); 1: code objects whose name could not be read.
BPF_PERCPU_ARRAY(pyx_counters, u64, 2);

static __always_inline void pyx_count(int i) {
    u64 *c = pyx_counters.lookup(&i);
    if (c)
        (*c)++;
}

static __always_inline u8 pyx_decide(struct pyx_target *t, u64 code) {
    u64 name = 0, len = 0;
    u64 w[PYX_NAME_WORDS] = {};
    if (bpf_probe_read_user(&name, sizeof(name), (void *)(code + t->code_name)) ||
        bpf_probe_read_user(&len, sizeof(len), (void *)(name + t->unicode_length)) ||
        bpf_probe_read_user(w, sizeof(w), (void *)(name + t->unicode_ascii_size))) {
        pyx_count(1);
        return VERDICT_SKIP;
    }
#pragma unroll
    for (int i = 0; i < PYX_NAME_WORDS; i++) {  // bytes past the name's end do not take part
        u64 left = len > 8 * i ? len - 8 * i : 0;
        if (left < 8)
            w[i] &= left ? (1ULL << (8 * left)) - 1 : 0;
    }
#pragma unroll
    for (int i = 0; i < PYX_NAMES; i++) {
        int k = i;
        struct pyx_name *n = pyx_names.lookup(&k);
        if (!n || !n->len || n->len != len)
            continue;
        if (n->w[0] == w[0] && n->w[1] == w[1] && n->w[2] == w[2] && n->w[3] == w[3])
            return VERDICT_TIMED;
    }
    return VERDICT_SKIP;
}

static __always_inline void pyx_add(struct pyx_val *v, u64 ns) {
    if (!v)
        return;
    __sync_fetch_and_add(&v->count, 1);
    __sync_fetch_and_add(&v->total_ns, ns);
    __sync_fetch_and_add(&v->hist[hist_slot(ns)], 1);
    if (ns > v->max_ns)
        v->max_ns = ns;  // racy max is fine: user space bounds a window's max by its histogram
}

int pyx_enter(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    u32 pid = id >> 32;
    struct pyx_target *t = pyx_targets.lookup(&pid);
    if (!t)
        return 0;
    __sync_fetch_and_add(&t->entries, 1);
    u64 code = 0;
    if (bpf_probe_read_user(&code, sizeof(code), (void *)(PT_REGS_PARM2(ctx) + t->frame_code)))
        return 0;
    code &= ~t->code_tag_mask;
    struct pyx_code_key key = {.pid = pid, .code = code};
    u8 *known = pyx_verdict.lookup(&key);
    u8 verdict;
    if (known) {
        verdict = *known;
    } else {
        verdict = pyx_decide(t, code);
        pyx_verdict.update(&key, &verdict);
    }
    if (verdict != VERDICT_TIMED)
        return 0;
    u32 tid = id;
    struct pyx_active zero = {.pid = pid};
    struct pyx_active *a = pyx_active.lookup_or_try_init(&tid, &zero);
    if (!a)
        return 0;
    u32 d = a->depth;
    if (d >= PYX_DEPTH) {
        pyx_count(0);
        return 0;
    }
    d &= PYX_DEPTH - 1;
    a->sp[d] = PT_REGS_SP(ctx);
    a->code[d] = code;
    a->pid = pid;
    a->ts[d] = bpf_ktime_get_ns();
    a->depth = d + 1;
    return 0;
}

int pyx_return(struct pt_regs *ctx) {
    u32 tid = bpf_get_current_pid_tgid();
    struct pyx_active *a = pyx_active.lookup(&tid);
    if (!a)
        return 0;
    u32 d = a->depth;
    if (d == 0 || d > PYX_DEPTH)
        return 0;
    u32 top = (d - 1) & (PYX_DEPTH - 1);
    if (a->sp[top] + 8 != PT_REGS_SP(ctx))  // the return of an eval call nested in the timed one
        return 0;
    u64 now = bpf_ktime_get_ns(), ns = now - a->ts[top];
    a->depth = top;
    trace_emit(TRACE_PY_CALL, a->pid, tid, 0, a->ts[top], now, 0, a->code[top]);
    struct pyx_code_key key = {.pid = a->pid, .code = a->code[top]};
    struct pyx_val zero = {};
    pyx_add(pyx_stats.lookup_or_try_init(&key, &zero), ns);
    return 0;
}

// Garbage collections, where the interpreter has no gc_collect_main symbol to probe but the USDT probes
// python:gc__start / gc__done (Debian's python3.11): one collection from start to done, per thread.
BPF_HASH(pyx_gc_start, u32, u64, 16384);
BPF_HASH(pyx_gc, u32, struct pyx_val, 1024);

int pyx_gc_enter(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    u32 pid = id >> 32, tid = id;
    if (!pyx_targets.lookup(&pid))
        return 0;
    u64 ts = bpf_ktime_get_ns();
    pyx_gc_start.update(&tid, &ts);
    return 0;
}

int pyx_gc_return(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    u32 pid = id >> 32, tid = id;
    u64 *ts = pyx_gc_start.lookup(&tid);
    if (!ts)
        return 0;
    u64 now = bpf_ktime_get_ns(), ns = now - *ts;
    trace_emit(TRACE_PY_CALL, pid, tid, 0, *ts, now, 0, 0);
    pyx_gc_start.delete(&tid);
    struct pyx_val zero = {};
    pyx_add(pyx_gc.lookup_or_try_init(&pid, &zero), ns);
    return 0;
}
