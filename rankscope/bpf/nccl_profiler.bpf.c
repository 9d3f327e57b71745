// NCCL's own view of communication from rankscope's NCCL profiler plugin (cupti_shim/nccl_profiler.c), through
// its USDT probes:
//   rankscope:nccl_coll(comm, rank, func, bytes, gpu_ns, seq): one collective's GPU-side span;
//   rankscope:nccl_link(comm, rank, peer, send, steps, bytes, wire_ns, peer_wait_ns): one link's network steps
//   since the plugin's previous hand-over (the plugin sums steps in place; the probe fires once a period).
// Aggregated here per process; counters only grow: the agent reads differences.
#include <uapi/linux/ptrace.h>

#include "histogram.h"
#include "trace.h"

struct coll_key {
    u32 pid;
    u32 pad;
    u64 func;  // NCCL's name string of the function, one per function in the process
};
struct coll_val {
    u64 count;
    u64 total_ns;
    u64 bytes;
    u64 hist[HIST_SLOTS];
};
BPF_HASH(nccl_coll_gpu, struct coll_key, struct coll_val, 256);
BPF_ARRAY(coll_zero, struct coll_val, 1);  // a new aggregate's zeros, off the 512-byte stack

struct link_key {
    u32 pid;
    u32 rank;  // the process's rank in the communicator
    u64 comm;  // NCCL's commHash
    u32 peer;
    u32 send;
};
struct link_val {
    u64 steps;
    u64 bytes;
    u64 wire_ns;
    u64 peer_wait_ns;
};
BPF_HASH(nccl_links, struct link_key, struct link_val, 4096);

int on_nccl_coll(struct pt_regs *ctx) {
    u64 func = 0, bytes = 0, ns = 0;
    bpf_usdt_readarg(3, ctx, &func);
    bpf_usdt_readarg(4, ctx, &bytes);
    bpf_usdt_readarg(5, ctx, &ns);
    // The plugin hands a span over when its last channel ends: placed to end now (the GPU clock is NCCL's).
    u64 id = bpf_get_current_pid_tgid(), now = bpf_ktime_get_ns();
    trace_emit(TRACE_NCCL, id >> 32, (u32)id, 0, now > ns ? now - ns : 0, now, bytes, func);
    struct coll_key key = {.pid = id >> 32, .func = func};
    int zero_idx = 0;
    struct coll_val *zero = coll_zero.lookup(&zero_idx);
    struct coll_val *v = zero ? nccl_coll_gpu.lookup_or_try_init(&key, zero) : NULL;
    if (!v)
        return 0;
    __sync_fetch_and_add(&v->count, 1);
    __sync_fetch_and_add(&v->total_ns, ns);
    __sync_fetch_and_add(&v->bytes, bytes);
    __sync_fetch_and_add(&v->hist[hist_slot(ns)], 1);
    return 0;
}

int on_nccl_link(struct pt_regs *ctx) {
    u64 comm = 0, rank = 0, peer = 0, send = 0, steps = 0, bytes = 0, wire = 0, wait = 0;
    bpf_usdt_readarg(1, ctx, &comm);
    bpf_usdt_readarg(2, ctx, &rank);
    bpf_usdt_readarg(3, ctx, &peer);
    bpf_usdt_readarg(4, ctx, &send);
    bpf_usdt_readarg(5, ctx, &steps);
    bpf_usdt_readarg(6, ctx, &bytes);
    bpf_usdt_readarg(7, ctx, &wire);
    bpf_usdt_readarg(8, ctx, &wait);
    struct link_key key = {.pid = bpf_get_current_pid_tgid() >> 32, .rank = rank, .comm = comm, .peer = peer,
                           .send = send};
    struct link_val zero = {};
    struct link_val *v = nccl_links.lookup_or_try_init(&key, &zero);
    if (!v)
        return 0;
    __sync_fetch_and_add(&v->steps, steps);
    __sync_fetch_and_add(&v->bytes, bytes);
    __sync_fetch_and_add(&v->wire_ns, wire);
    __sync_fetch_and_add(&v->peer_wait_ns, wait);
    return 0;
}
