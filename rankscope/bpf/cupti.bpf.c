// GPU activity from the rankscope CUPTI shim (cupti_shim/shim.c), through its USDT probes: batches,
// rankscope:activities(records, count, lost), one trap per ACTIVITY_BATCH records; or, from a shim built
// without that probe, rankscope:activity(kind, start, end, device, stream, correlation, name, bytes), one
// trap per record. Aggregated here per (process, record kind, kernel) and GPU busy time per (process,
// device); each record is also sent raw to user space only while `raw_on` is set (deep mode, tests).
// Counters only grow: the agent reads differences. Composed after bpf/cupti_launch.bpf.c (join, join_kernel).
#include <uapi/linux/ptrace.h>

#include "histogram.h"
#define TRACE_PAGES 64  // 256 KiB a process: ~5k records between two reads of a capture
#include "trace.h"


struct act_key {
    u32 pid;
    u32 kind;  // CUpti_ActivityKind: 10 concurrent kernel, 1 memcpy, 2 memset
    u64 name;  // CUPTI's kernel name pointer, one per kernel in the process (0 for copies and sets)
};
struct act_val {
    u64 count;
    u64 total_ns;
    u64 bytes;
    u64 hist[HIST_SLOTS];
};
BPF_HASH(gpu_activity, struct act_key, struct act_val, 4096);
BPF_ARRAY(act_zero, struct act_val, 1);  // never written: a new aggregate's zeros, off the 512-byte stack

// Busy time as the union of activity intervals per device: records of one device arrive about in end
// order, so an interval only adds the part after the latest end seen.
struct dev_key {
    u32 pid;
    u32 device;
};
struct dev_val {
    u64 busy_ns;
    u64 last_end;
};
BPF_HASH(gpu_busy, struct dev_key, struct dev_val, 1024);

struct raw_activity {
    u32 pid;
    u32 kind;
    u64 start;
    u64 end;
    u32 device;
    u32 stream;
    u32 correlation;
    u32 pad;
    u64 name;
    u64 bytes;
};
BPF_RINGBUF_OUTPUT(raw_activity, 64);  // pages
BPF_ARRAY(raw_on, u32, 1);

// One record of a batch, as the shim copies it (cupti_shim/shim.c struct rankscope_record).
struct shim_record {
    u32 kind;
    u32 device;
    u64 start;
    u64 end;
    u32 stream;       // thread id for launch records
    u32 correlation;
    u64 name;
    u64 bytes;        // callback id for launch records
};
#define ACTIVITY_BATCH 16  // records per trap: the shim's ACTIVITY_BATCH
#define KIND_RUNTIME 5
#define KIND_DRIVER 4
// Records the shim lost (CUPTI's dropped records, its rate limits) as it last said, per process.
BPF_HASH(shim_lost, u32, u64, 1024);

// One activity record: its kernel's aggregate, its device's busy time, the capture, raw (deep), its launch.
static __always_inline void take_activity(struct raw_activity *r) {
    u64 ns = r->end > r->start ? r->end - r->start : 0;
    struct act_key key = {.pid = r->pid, .kind = r->kind, .name = r->name};
    int zero_idx = 0;
    struct act_val *zero = act_zero.lookup(&zero_idx);
    struct act_val *v = zero ? gpu_activity.lookup_or_try_init(&key, zero) : NULL;
    if (v) {
        __sync_fetch_and_add(&v->count, 1);
        __sync_fetch_and_add(&v->total_ns, ns);
        __sync_fetch_and_add(&v->bytes, r->bytes);
        __sync_fetch_and_add(&v->hist[hist_slot(ns)], 1);
    }

    struct dev_key dk = {.pid = r->pid, .device = r->device};
    struct dev_val dzero = {};
    struct dev_val *d = gpu_busy.lookup_or_try_init(&dk, &dzero);
    if (d && r->end > d->last_end) {  // one CUPTI thread delivers a process's buffers: no race to guard
        u64 from = r->start > d->last_end ? r->start : d->last_end;
        d->busy_ns += r->end - from;
        d->last_end = r->end;
    }

    u64 kernel = r->kind == 3 || r->kind == 10;  // carries its correlation (to its launch) where copies carry bytes
    trace_emit(TRACE_GPU, r->pid, r->stream, r->kind | r->device << 8, r->start, r->end,
               kernel ? r->correlation : r->bytes, r->name);
    u32 *on = raw_on.lookup(&zero_idx);
    if (on && *on)
        raw_activity.ringbuf_output(r, sizeof(*r), 0);
    // Kernel, concurrent kernel records wait for or complete their launch (cupti_launch.bpf.c).
    if (kernel)
        join_kernel(r->pid, r->correlation, r->start);
}

int on_activity(struct pt_regs *ctx) {
    struct raw_activity r = {.pid = bpf_get_current_pid_tgid() >> 32};
    u64 kind = 0, device = 0, stream = 0, correlation = 0;
    bpf_usdt_readarg(1, ctx, &kind);
    bpf_usdt_readarg(2, ctx, &r.start);
    bpf_usdt_readarg(3, ctx, &r.end);
    bpf_usdt_readarg(4, ctx, &device);
    bpf_usdt_readarg(5, ctx, &stream);
    bpf_usdt_readarg(6, ctx, &correlation);
    bpf_usdt_readarg(7, ctx, &r.name);
    bpf_usdt_readarg(8, ctx, &r.bytes);
    r.kind = kind;
    r.device = device;
    r.stream = stream;
    r.correlation = correlation;
    take_activity(&r);
    return 0;
}

// A batch: each record read from the shim's array in turn (launch records join their kernels).
int on_activities(struct pt_regs *ctx) {
    u64 records = 0, count = 0, lost = 0;
    bpf_usdt_readarg(1, ctx, &records);
    bpf_usdt_readarg(2, ctx, &count);
    bpf_usdt_readarg(3, ctx, &lost);
    u32 pid = bpf_get_current_pid_tgid() >> 32;
    if (lost)
        shim_lost.update(&pid, &lost);
    struct shim_record s;
    for (int i = 0; i < ACTIVITY_BATCH && i < count; i++) {
        if (bpf_probe_read_user(&s, sizeof(s), (void *)(records + i * sizeof(s))))
            break;
        if (s.kind == KIND_RUNTIME || s.kind == KIND_DRIVER) {
            if (s.correlation)
                join(pid, s.correlation, JOIN_LAUNCH, s.end);
            continue;
        }
        struct raw_activity r = {.pid = pid, .kind = s.kind, .start = s.start, .end = s.end, .device = s.device,
                                 .stream = s.stream, .correlation = s.correlation, .name = s.name,
                                 .bytes = s.bytes};
        take_activity(&r);
    }
    return 0;
}
