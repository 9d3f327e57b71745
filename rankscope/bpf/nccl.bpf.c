// NCCL (libnccl.so.2): collectives with their payload, and communicator set-up, which tells each
// process its rank, the communicator size and an id shared by every rank of the job. The collectives'
// handlers, one macro line of common.h per probe, are generated from agent/sources/probes/nccl.py, the one
// list of its symbols; ncclCommInitRank's (HAND_WRITTEN there) are below.
#include "common.h"

static __always_inline u64 nccl_type_size(u64 dtype) {
    switch (dtype) {
    case 0: case 1: return 1;          // int8, uint8
    case 6: case 9: return 2;          // float16, bfloat16
    case 2: case 3: case 7: return 4;  // int32, uint32, float32
    case 4: case 5: case 8: return 8;  // int64, uint64, float64
    default: return 0;
    }
}

// Communicators of each process: rank, size and a hash of the ncclUniqueId every member shares. A failed
// set-up is kept too, with its result and a null comm: the rank still said who it is.
struct comm_key {
    u32 pid;
    u32 pad;
    u64 comm;  // the ncclComm_t the call returned
};
struct comm_info {
    s32 rank;
    s32 nranks;
    u64 id_hash;
    s32 result;  // ncclResult_t: 0 ncclSuccess
    u32 pad;
};
BPF_HASH(comms, struct comm_key, struct comm_info, 4096);

struct comm_init {
    u64 comm_out;  // ncclComm_t* argument, read on return
    struct comm_info info;
};
BPF_HASH(comm_inits, u32, struct comm_init, 1024);  // by thread

struct unique_id {
    u8 bytes[128];
};
BPF_PERCPU_ARRAY(id_scratch, struct unique_id, 1);  // too big for the 512-byte BPF stack

// ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank): the 128-byte id is passed
// by value on the stack (so rank takes the third integer register).
int enter_ncclCommInitRank(struct pt_regs *ctx) {
    if (!watched_proc())
        return 0;
    int zero = 0;
    struct unique_id *id = id_scratch.lookup(&zero);
    if (!id || bpf_probe_read_user(id->bytes, sizeof(id->bytes), (void *)(PT_REGS_SP(ctx) + 8)))
        return 0;
    u64 h = 14695981039346656037ULL;  // FNV-1a
    for (int i = 0; i < 128; i++) {
        h ^= id->bytes[i];
        h *= 1099511628211ULL;
    }
    struct comm_init init = {.comm_out = PT_REGS_PARM1(ctx),
                             .info = {.rank = (s32)PT_REGS_PARM3(ctx), .nranks = (s32)PT_REGS_PARM2(ctx),
                                      .id_hash = h}};
    u32 tid = bpf_get_current_pid_tgid();
    comm_inits.update(&tid, &init);
    return 0;
}

int return_ncclCommInitRank(struct pt_regs *ctx) {
    u32 tid = bpf_get_current_pid_tgid();
    struct comm_init *init = comm_inits.lookup(&tid);
    if (!init)
        return 0;
    struct comm_key key = {.pid = bpf_get_current_pid_tgid() >> 32};
    init->info.result = PT_REGS_RC(ctx);
    if (init->info.result == 0)
        bpf_probe_read_user(&key.comm, sizeof(key.comm), (void *)init->comm_out);
    comms.update(&key, &init->info);
    comm_inits.delete(&tid);
    return 0;
}
