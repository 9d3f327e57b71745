// gloo inside PyTorch's libtorch_cpu.so (c10d's ProcessGroupGloo): CPU training jobs.
// c10d::ProcessGroupGloo::<op> enqueues a collective on the training thread and returns a Work at once:
// counted. One of the process group's worker threads then runs gloo::<op>, which returns only when every
// rank has taken part: a blocking collective, timed, complete when it returns. DDP's reducer waits for them
// in c10d::Reducer::finalize_backward, on the training thread: timed.
// Probe names are C identifiers; agent/sources/probes/gloo.py maps them to the mangled C++ symbols and
// declares their handlers (one macro line of common.h each, generated), with gloo_payload's offsets.
#include "common.h"

// Payload of a gloo options object: its element count and element size (two adjacent size_t) at
// `offset`. The layouts (x86-64, libstdc++) of gloo as bundled with torch 2.13:
//   AllreduceOptions { AllreduceOptionsImpl { shared_ptr<Context> context; milliseconds timeout;
//     Algorithm algorithm; vector<unique_ptr<UnboundBuffer>> in, out; size_t elements, elementSize; ... } }
//     -> elements at 80
//   BroadcastOptions { shared_ptr<Context> context; unique_ptr<UnboundBuffer> in, out;
//     size_t elements, elementSize; int root; ... } -> elements at 32
// A value that does not look like one (another layout) gives 0 bytes rather than a wrong payload.
static __always_inline u64 gloo_payload(u64 opts, u64 offset) {
    u64 v[2] = {};
    if (!opts || bpf_probe_read_user(v, sizeof(v), (void *)(opts + offset)))
        return 0;
    u64 elements = v[0], size = v[1];
    if ((size != 1 && size != 2 && size != 4 && size != 8) || elements > (1ULL << 40))
        return 0;
    return elements * size;
}
