// Kernel launches from the rankscope CUPTI shim's probe rankscope:launch(correlation, api_start, api_end,
// thread, cbid), joined to their kernel's record (rankscope:activity, bpf/cupti.bpf.c calls join_kernel) by
// (process, correlation id). CUPTI delivers API and kernel records in different buffers, in either order:
// whichever comes first waits in an LRU hash for the other. Per process: joined launches and the queue delay,
// kernel GPU start - launch API end (CUPTI's one clock), as a log2 histogram and a total. Near zero: the GPU
// waits for the host; large: the host runs ahead of a busy GPU. Composed before bpf/cupti.bpf.c.
// Small values only: on_activity's stack already holds the activity record and its aggregate.
#include <uapi/linux/ptrace.h>

#include "histogram.h"


#define JOIN_LAUNCH 1
#define JOIN_KERNEL 2
#define JOIN_DONE 4

struct join_key {
    u32 pid;
    u32 correlation;
};
struct join_val {
    u64 launch_end;    // API end ns, once the launch came
    u64 kernel_start;  // GPU start ns, once the kernel came
    u32 have;          // JOIN_* bits
    u32 pad;
};
// Joined entries stay (marked done) until evicted, so the second record of a runtime launch and its nested
// driver launch, or a graph's later kernels (one correlation id for the whole graph), find the id taken.
// Sized for ~1 s of launches in flight at the shim's rate limit; an evicted half is simply never joined.
BPF_TABLE("lru_hash", struct join_key, struct join_val, launch_join, 65536);

struct queue_val {
    u64 joined;
    u64 total_ns;
};
BPF_HASH(launch_queue, u32, struct queue_val, 1024);
struct queue_slot {
    u32 pid;
    u32 slot;  // bpf_log2l(delay ns)
};
BPF_HASH(launch_queue_hist, struct queue_slot, u64, 1024 * HIST_SLOTS);
BPF_ARRAY(join_on, u32, 1);  // set while the launch probe is attached: kernels wait for launches only then

// One half of a launch-kernel pair arrived. One CUPTI thread delivers a process's buffers: no race to guard.
static __always_inline void join(u32 pid, u32 correlation, u32 side, u64 ts) {
    struct join_key key = {.pid = pid, .correlation = correlation};
    struct join_val first = {.have = side};
    if (side == JOIN_LAUNCH)
        first.launch_end = ts;
    else
        first.kernel_start = ts;
    if (launch_join.insert(&key, &first) == 0)
        return;  // the first half: waits for the other
    struct join_val *v = launch_join.lookup(&key);
    if (!v || (v->have & (side | JOIN_DONE)))
        return;  // evicted meanwhile, or a twin of a half already seen
    u64 end = side == JOIN_LAUNCH ? ts : v->launch_end;
    u64 start = side == JOIN_KERNEL ? ts : v->kernel_start;
    v->have |= side | JOIN_DONE;
    u64 delay = start > end ? start - end : 0;  // a kernel may start before its launch call returns

    struct queue_val zero = {};
    struct queue_val *q = launch_queue.lookup_or_try_init(&pid, &zero);
    if (!q)
        return;
    __sync_fetch_and_add(&q->joined, 1);
    __sync_fetch_and_add(&q->total_ns, delay);
    struct queue_slot qs = {.pid = pid, .slot = hist_slot(delay)};
    launch_queue_hist.increment(qs);
}

static __always_inline void join_kernel(u32 pid, u32 correlation, u64 start) {
    int zero_idx = 0;
    u32 *on = join_on.lookup(&zero_idx);
    if (on && *on && correlation)
        join(pid, correlation, JOIN_KERNEL, start);
}

int on_launch(struct pt_regs *ctx) {
    u64 correlation = 0, api_end = 0;
    bpf_usdt_readarg(1, ctx, &correlation);
    bpf_usdt_readarg(3, ctx, &api_end);
    if (correlation)
        join(bpf_get_current_pid_tgid() >> 32, correlation, JOIN_LAUNCH, api_end);
    return 0;
}
