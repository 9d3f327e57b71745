// A trace capture (agent/trace_capture.py, loader/trace_stream.py): events stream to user space only while one
// runs for the process. Each BPF object that includes this header has its own stream (the uprobe program, the
// Python sampler and timer, each CUPTI shim reader); the capture reads them all. Outside a capture, a probe
// hit pays one array lookup more (trace_on) and nothing else. Events that find the stream full are counted in
// trace_lost; the capture shows them in the trace.
#ifndef RANKSCOPE_TRACE_H
#define RANKSCOPE_TRACE_H

#ifndef TRACE_PAGES
#define TRACE_PAGES 512  // 2 MiB, ~43k events between two reads (the capture reads every 50 ms)
#endif
#define TRACE_CALL 1        // a timed call returned on its thread
#define TRACE_COLLECTIVE 2  // a collective completed: enqueue to completion
#define TRACE_INSTANT 3     // a counted call (kernel launches: no uretprobe, so no duration)
#define TRACE_SCHED 4       // the main thread left a scheduler state (fn: the state, sched.bpf.c's enum)
#define TRACE_PY_CALL 5     // an exactly timed Python function returned (seq: its code object; 0: a GC)
#define TRACE_PY_SAMPLE 6   // an on-CPU sample of a Python stack (the record is followed by the stack)
#define TRACE_GPU 7         // a CUPTI activity record: CUPTI's clock; tid: stream, fn: kind | device << 8,
                            // seq: kernel name, bytes: a copy's or set's bytes, a kernel's correlation id
#define TRACE_NCCL 8        // an NCCL collective's GPU span from the profiler plugin (seq: NCCL's function name)
struct trace_rec {
    u32 kind;
    u32 pid;
    u32 tid;
    u32 fn;
    u64 start_ns;
    u64 end_ns;
    u64 bytes;
    u64 seq;  // a collective's number in its process (its enqueue call carries it too); else per kind
};
BPF_ARRAY(trace_on, u32, 1);            // nonzero while a capture runs
BPF_HASH(trace_pids, u32, u32, 1024);   // the processes it captures
BPF_RINGBUF_OUTPUT(trace_events, TRACE_PAGES);
BPF_ARRAY(trace_lost, u64, 1);

static __always_inline bool tracing(u32 pid) {
    int zero = 0;
    u32 *on = trace_on.lookup(&zero);
    return on && *on && trace_pids.lookup(&pid);
}

static __always_inline void trace_count_lost(void) {
    int zero = 0;
    u64 *lost = trace_lost.lookup(&zero);
    if (lost)
        __sync_fetch_and_add(lost, 1);
}

static __always_inline void trace_emit(u32 kind, u32 pid, u32 tid, u32 fn, u64 start, u64 end, u64 bytes,
                                       u64 seq) {
    if (!tracing(pid))
        return;
    struct trace_rec r = {.kind = kind, .pid = pid, .tid = tid, .fn = fn, .start_ns = start, .end_ns = end,
                          .bytes = bytes, .seq = seq};
    if (trace_events.ringbuf_output(&r, sizeof(r), 0))
        trace_count_lost();
}

// The same, for the calling thread.
static __always_inline void trace_here(u32 kind, u32 fn, u64 start, u64 end, u64 bytes, u64 seq) {
    u64 id = bpf_get_current_pid_tgid();
    trace_emit(kind, id >> 32, (u32)id, fn, start, end, bytes, seq);
}
#endif
