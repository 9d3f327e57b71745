/* Stand-in libnccl.so.2 for machines without GPUs (rankscope simulator).
 *
 * Exports NCCL names with their real C signatures (x86-64 SysV); as in the real library, each ncclX is a
 * weak alias of pncclX at the same address. Collectives only enqueue (like NCCL, the call returns at
 * once): each becomes an entry on the caller's stream of libcuda.so.1 (this library's DT_NEEDED), which
 * starts at arrival = max(stream tail, now). The arrival is published in a shared-memory rendezvous of the
 * communicator, and the entry completes at
 *     max(arrival over the ranks involved) + bytes * algorithm factor / bandwidth of this rank,
 * bandwidth = 10 GB/s / link factor (rsim_set_link_factor). The end is only known once every rank has
 * arrived, so synchronizes behind it wait for the peers (futex on a shared counter, bounded waits).
 *
 * Shared memory "/rankscope-sim-<FNV-1a of the unique id>": a header, per-rank state, per-rank rings
 * of (seq, arrival) for collectives (seq = per-communicator order of calls) and per-pair rings for
 * send/recv (seq = per-direction order). Rank 0 creates it (replacing any stale segment of that name);
 * the others open it and rejoin if it is replaced. Rank 0, or the last rank to detach, unlinks it. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "rsim.h"

typedef int ncclResult_t;
enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7,
};

typedef struct ncclComm *ncclComm_t;
typedef CUstream cudaStream_t;

#define NCCL_UNIQUE_ID_BYTES 128
typedef struct {
    char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

typedef enum {
    ncclInt8 = 0, ncclChar = 0,
    ncclUint8 = 1,
    ncclInt32 = 2, ncclInt = 2,
    ncclUint32 = 3,
    ncclInt64 = 4,
    ncclUint64 = 5,
    ncclFloat16 = 6, ncclHalf = 6,
    ncclFloat32 = 7, ncclFloat = 7,
    ncclFloat64 = 8, ncclDouble = 8,
    ncclBfloat16 = 9,
    ncclNumTypes = 10
} ncclDataType_t;

typedef enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4, ncclNumOps = 5 } ncclRedOp_t;

#define NCCL_VERSION_CODE 22105 /* 2.21.5 */
#define LINK_BYTES_PER_NS 10.0  /* 10 GB/s */
#define MAX_RANKS 1024
#define RING 1024     /* collective slots per rank */
#define P2P_RING 16   /* send/recv slots per ordered pair */
#define COMM_MAGIC 0x6e63636cU
#define SHM_MAGIC 0x706f63736b6e6172ULL /* "rankscop" */
#define SHM_VERSION 1
#define WAIT_SLICE_NS 2000000LL  /* longest futex wait before looking again */
#define INIT_POLL_NS 1000000LL   /* communicator set-up polls every 1 ms */
#define STALE_CHECK_NS 10000000LL

enum rank_state { R_NONE = 0, R_JOINED = 1, R_READY = 2, R_DETACHED = 3 };

struct shm_slot {
    _Atomic uint64_t seq; /* 0: empty or being written */
    _Atomic int64_t arrival;
};

struct shm_pair_slot {
    struct shm_slot send; /* the sender's arrival for message seq */
    struct shm_slot recv; /* the receiver's arrival */
};

struct shm_rank {
    _Atomic int32_t pid;
    _Atomic int32_t state;
    char pad[56];
};

struct shm_hdr {
    _Atomic uint64_t magic; /* written last by the creator */
    uint32_t version;
    uint32_t nranks;
    unsigned char id[NCCL_UNIQUE_ID_BYTES];
    _Atomic uint32_t posted;  /* futex word: bumped after every published arrival */
    _Atomic uint32_t waiters;
    _Atomic uint32_t detached;
};

struct ncclComm {
    uint32_t magic;
    int rank, nranks;
    _Atomic int refs;
    int destroyed;
    char name[64];
    dev_t dev;
    ino_t ino;
    size_t size;
    unsigned char *base;
    struct shm_hdr *hdr;
    struct shm_rank *ranks;
    struct shm_slot *slots;      /* [nranks][RING] */
    struct shm_pair_slot *pairs; /* [nranks (src)][nranks (dst)][P2P_RING] */
    _Atomic uint64_t coll_seq;
    _Atomic uint64_t *send_seq;  /* per peer */
    _Atomic uint64_t *recv_seq;
};

enum member_kind { M_COLLECTIVE, M_SEND, M_RECV };

struct member {
    struct ncclComm *comm;
    enum member_kind kind;
    int peer;
    uint64_t seq;
    int64_t transfer; /* ns on this rank's link */
};

struct op {
    int published;
    int n;
    struct member m[];
};

static volatile double link_factor = 1.0;

static __thread int group_depth;
static __thread struct member *group_members;
static __thread int group_n, group_cap;
static __thread cudaStream_t group_stream;

/* ---------------------------------------------------------------- shared memory */

static size_t align64(size_t x) { return (x + 63) & ~(size_t)63; }

static size_t shm_layout(int n, size_t *ranks_off, size_t *slots_off, size_t *pairs_off) {
    *ranks_off = align64(sizeof(struct shm_hdr));
    *slots_off = align64(*ranks_off + (size_t)n * sizeof(struct shm_rank));
    *pairs_off = align64(*slots_off + (size_t)n * RING * sizeof(struct shm_slot));
    return *pairs_off + (size_t)n * n * P2P_RING * sizeof(struct shm_pair_slot);
}

static uint64_t fnv1a(const unsigned char *p, size_t n) {
    uint64_t h = 14695981039346656037ULL;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 1099511628211ULL;
    }
    return h;
}

static void shm_name_of(const unsigned char *id, char *out, size_t len) {
    snprintf(out, len, "/rankscope-sim-%016llx", (unsigned long long)fnv1a(id, NCCL_UNIQUE_ID_BYTES));
}

static void comm_map(struct ncclComm *c, unsigned char *base) {
    size_t ro, so, po;
    shm_layout(c->nranks, &ro, &so, &po);
    c->base = base;
    c->hdr = (struct shm_hdr *)base;
    c->ranks = (struct shm_rank *)(base + ro);
    c->slots = (struct shm_slot *)(base + so);
    c->pairs = (struct shm_pair_slot *)(base + po);
}

static void comm_unmap(struct ncclComm *c) {
    if (c->base)
        munmap(c->base, c->size);
    c->base = NULL;
    c->hdr = NULL;
}

/* Opens (rank 0: creates afresh) the segment. 0: mapped; 1: not there yet, try again; -1: error. */
static int comm_open(struct ncclComm *c, const unsigned char *id) {
    struct stat st;
    int fd;
    if (c->rank == 0) {
        shm_unlink(c->name); /* a stale segment of an earlier run with this id */
        fd = shm_open(c->name, O_CREAT | O_EXCL | O_RDWR, 0600);
        if (fd < 0)
            return errno == EEXIST ? 1 : -1;
        if (ftruncate(fd, (off_t)c->size) < 0 || fstat(fd, &st) < 0) {
            close(fd);
            shm_unlink(c->name);
            return -1;
        }
    } else {
        fd = shm_open(c->name, O_RDWR, 0);
        if (fd < 0)
            return errno == ENOENT ? 1 : -1;
        if (fstat(fd, &st) < 0 || (size_t)st.st_size < c->size) { /* not sized yet, or a stale one */
            close(fd);
            return 1;
        }
    }
    void *base = mmap(NULL, c->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (base == MAP_FAILED)
        return -1;
    comm_map(c, base);
    c->dev = st.st_dev;
    c->ino = st.st_ino;
    if (c->rank == 0) {
        c->hdr->version = SHM_VERSION;
        c->hdr->nranks = (uint32_t)c->nranks;
        memcpy(c->hdr->id, id, NCCL_UNIQUE_ID_BYTES);
        atomic_store_explicit(&c->hdr->magic, SHM_MAGIC, memory_order_release);
    } else if (atomic_load_explicit(&c->hdr->magic, memory_order_acquire) != SHM_MAGIC ||
               c->hdr->version != SHM_VERSION || c->hdr->nranks != (uint32_t)c->nranks ||
               memcmp(c->hdr->id, id, NCCL_UNIQUE_ID_BYTES) != 0) {
        comm_unmap(c); /* being set up, or not ours: look again later */
        return 1;
    }
    return 0;
}

/* Whether the name now refers to another segment than the one mapped (rank 0 replaced a stale one). */
static int comm_replaced(struct ncclComm *c) {
    struct stat st;
    int fd = shm_open(c->name, O_RDONLY, 0);
    if (fd < 0)
        return 1;
    int same = fstat(fd, &st) == 0 && st.st_dev == c->dev && st.st_ino == c->ino;
    close(fd);
    return !same;
}

static void comm_unlink_if_ours(struct ncclComm *c) {
    if (!comm_replaced(c))
        shm_unlink(c->name);
}

static int pid_alive(int pid) { return pid > 0 && (kill(pid, 0) == 0 || errno == EPERM); }

/* Every rank joined; those still in set-up are alive (a segment left by a crashed run is not joined). */
static int all_joined(struct ncclComm *c) {
    for (int r = 0; r < c->nranks; r++) {
        int state = atomic_load(&c->ranks[r].state);
        if (state == R_NONE)
            return 0;
        if (state != R_DETACHED && !pid_alive(atomic_load(&c->ranks[r].pid)))
            return 0;
    }
    return 1;
}

static void comm_free(struct ncclComm *c) {
    comm_unmap(c);
    free(c->send_seq);
    free(c->recv_seq);
    c->magic = 0;
    free(c);
}

static void comm_ref(struct ncclComm *c) { atomic_fetch_add(&c->refs, 1); }

static void comm_unref(void *obj) {
    struct ncclComm *c = obj;
    if (atomic_fetch_sub(&c->refs, 1) == 1)
        comm_free(c);
}

/* Waits until another arrival was published on the communicator (or a bounded time passed). */
static int comm_wait(void *obj, uint32_t token) {
    struct ncclComm *c = obj;
    struct timespec slice = {.tv_sec = 0, .tv_nsec = WAIT_SLICE_NS};
    if (rsim_interrupt_pending())
        return -1;
    atomic_fetch_add(&c->hdr->waiters, 1);
    long rc = syscall(SYS_futex, (uint32_t *)&c->hdr->posted, FUTEX_WAIT, token, &slice, NULL, 0);
    int err = errno;
    atomic_fetch_sub(&c->hdr->waiters, 1);
    if (rc < 0 && err == EINTR && rsim_interruptible())
        return -1;
    return 0;
}

static void slot_post(struct shm_slot *s, uint64_t seq, int64_t arrival) {
    atomic_store_explicit(&s->seq, 0, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);
    atomic_store_explicit(&s->arrival, arrival, memory_order_relaxed);
    atomic_store_explicit(&s->seq, seq, memory_order_release);
}

/* 1 and *arrival when message `seq` was published (INT64_MIN if already overwritten), else 0. */
static int slot_read(struct shm_slot *s, uint64_t seq, int64_t *arrival) {
    for (;;) {
        uint64_t s1 = atomic_load_explicit(&s->seq, memory_order_acquire);
        if (s1 == 0 || s1 < seq)
            return 0;
        if (s1 > seq) {
            *arrival = INT64_MIN;
            return 1;
        }
        int64_t a = atomic_load_explicit(&s->arrival, memory_order_relaxed);
        atomic_thread_fence(memory_order_acquire);
        if (atomic_load_explicit(&s->seq, memory_order_relaxed) == s1) {
            *arrival = a;
            return 1;
        }
    }
}

static void comm_announce(struct ncclComm *c) {
    atomic_fetch_add(&c->hdr->posted, 1);
    if (atomic_load(&c->hdr->waiters))
        syscall(SYS_futex, (uint32_t *)&c->hdr->posted, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static struct shm_slot *coll_slot(struct ncclComm *c, int r, uint64_t seq) {
    return &c->slots[(size_t)r * RING + seq % RING];
}

static struct shm_pair_slot *pair_slot(struct ncclComm *c, int src, int dst, uint64_t seq) {
    return &c->pairs[((size_t)src * c->nranks + dst) * P2P_RING + seq % P2P_RING];
}

/* ---------------------------------------------------------------- stream entries (see rsim.h) */

static int64_t op_poll(void *ctx, int64_t start, rsim_waiter *w) {
    struct op *op = ctx;
    if (!op->published) {
        for (int i = 0; i < op->n; i++) {
            struct member *m = &op->m[i];
            struct ncclComm *c = m->comm;
            if (m->kind == M_COLLECTIVE)
                slot_post(coll_slot(c, c->rank, m->seq), m->seq, start);
            else if (m->kind == M_SEND)
                slot_post(&pair_slot(c, c->rank, m->peer, m->seq)->send, m->seq, start);
            else
                slot_post(&pair_slot(c, m->peer, c->rank, m->seq)->recv, m->seq, start);
            comm_announce(c);
        }
        op->published = 1;
    }
    int64_t last_arrival = start, transfer = 0;
    for (int i = 0; i < op->n; i++) {
        struct member *m = &op->m[i];
        struct ncclComm *c = m->comm;
        uint32_t token = atomic_load(&c->hdr->posted); /* before looking: no wake-up is missed */
        int64_t a;
        int ok = 1;
        if (m->kind == M_COLLECTIVE) {
            for (int r = 0; r < c->nranks && ok; r++) {
                if (r == c->rank)
                    continue;
                if ((ok = slot_read(coll_slot(c, r, m->seq), m->seq, &a)) && a > last_arrival)
                    last_arrival = a;
            }
        } else {
            struct shm_slot *peer = m->kind == M_SEND ? &pair_slot(c, c->rank, m->peer, m->seq)->recv
                                                      : &pair_slot(c, m->peer, c->rank, m->seq)->send;
            if ((ok = slot_read(peer, m->seq, &a)) && a > last_arrival)
                last_arrival = a;
        }
        if (!ok) {
            if (w) {
                comm_ref(c);
                w->wait = comm_wait;
                w->unref = comm_unref;
                w->obj = c;
                w->token = token;
            }
            return -1;
        }
        transfer += m->transfer;
    }
    return last_arrival + transfer;
}

static void op_release(void *ctx) {
    struct op *op = ctx;
    for (int i = 0; i < op->n; i++)
        comm_unref(op->m[i].comm);
    free(op);
}

static const rsim_ext_ops op_ops = {.poll = op_poll, .release = op_release};

static ncclResult_t op_submit(struct member *members, int n, cudaStream_t stream) {
    struct op *op = malloc(sizeof(*op) + (size_t)n * sizeof(struct member));
    if (!op) {
        for (int i = 0; i < n; i++)
            comm_unref(members[i].comm);
        return ncclSystemError;
    }
    op->published = 0;
    op->n = n;
    memcpy(op->m, members, (size_t)n * sizeof(struct member));
    if (rsim_stream_enqueue_external(stream, &op_ops, op) != 0) {
        op_release(op);
        return ncclUnhandledCudaError;
    }
    return ncclSuccess;
}

static size_t type_size(ncclDataType_t t) {
    switch ((int)t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: return 0;
    }
}

static int comm_ok(struct ncclComm *c) { return c && c->magic == COMM_MAGIC && !c->destroyed; }

/* Enqueues one collective or send/recv (or adds it to the open group). */
static ncclResult_t enqueue(struct ncclComm *c, enum member_kind kind, int peer, double bytes, double factor,
                            cudaStream_t stream) {
    struct member m = {.comm = c, .kind = kind, .peer = peer};
    if (kind == M_COLLECTIVE)
        m.seq = atomic_fetch_add(&c->coll_seq, 1) + 1;
    else if (kind == M_SEND)
        m.seq = atomic_fetch_add(&c->send_seq[peer], 1) + 1;
    else
        m.seq = atomic_fetch_add(&c->recv_seq[peer], 1) + 1;
    m.transfer = (int64_t)(bytes * factor / LINK_BYTES_PER_NS * link_factor);
    comm_ref(c);
    if (group_depth > 0) {
        if (group_n == group_cap) {
            int cap = group_cap ? group_cap * 2 : 16;
            struct member *grown = realloc(group_members, (size_t)cap * sizeof(*grown));
            if (!grown) {
                comm_unref(c);
                return ncclSystemError;
            }
            group_members = grown;
            group_cap = cap;
        }
        if (group_n == 0)
            group_stream = stream;
        group_members[group_n++] = m;
        return ncclSuccess;
    }
    return op_submit(&m, 1, stream);
}

static ncclResult_t check_collective(struct ncclComm *c, const void *send, const void *recv, size_t count,
                                     ncclDataType_t dtype) {
    if (!comm_ok(c))
        return ncclInvalidArgument;
    if (!type_size(dtype))
        return ncclInvalidArgument;
    if (count && (!send || !recv))
        return ncclInvalidArgument;
    return ncclSuccess;
}

/* ---------------------------------------------------------------- NCCL API (pnccl*, ncclX weak aliases) */

#define NCCL_ALIAS(name) __typeof__(p##name) name __attribute__((weak, alias("p" #name)))

RSIM_EXPORT ncclResult_t pncclGetVersion(int *version) {
    if (!version)
        return ncclInvalidArgument;
    *version = NCCL_VERSION_CODE;
    return ncclSuccess;
}
NCCL_ALIAS(ncclGetVersion);

RSIM_EXPORT const char *pncclGetErrorString(ncclResult_t result) {
    switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
    }
}
NCCL_ALIAS(ncclGetErrorString);

RSIM_EXPORT ncclResult_t pncclGetUniqueId(ncclUniqueId *uniqueId) {
    if (!uniqueId)
        return ncclInvalidArgument;
    size_t got = 0;
    while (got < sizeof(uniqueId->internal)) {
        ssize_t n = getrandom(uniqueId->internal + got, sizeof(uniqueId->internal) - got, 0);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return ncclSystemError;
        }
        got += (size_t)n;
    }
    return ncclSuccess;
}
NCCL_ALIAS(ncclGetUniqueId);

/* Blocks until all nranks ranks have joined the communicator (the ranks' real rendezvous). */
RSIM_EXPORT ncclResult_t pncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank) {
    if (!comm || nranks < 1 || nranks > MAX_RANKS || rank < 0 || rank >= nranks)
        return ncclInvalidArgument;
    struct ncclComm *c = calloc(1, sizeof(*c));
    if (!c)
        return ncclSystemError;
    c->send_seq = calloc((size_t)nranks, sizeof(*c->send_seq));
    c->recv_seq = calloc((size_t)nranks, sizeof(*c->recv_seq));
    if (!c->send_seq || !c->recv_seq) {
        comm_free(c);
        return ncclSystemError;
    }
    c->magic = COMM_MAGIC;
    c->rank = rank;
    c->nranks = nranks;
    atomic_store(&c->refs, 1);
    const unsigned char *id = (const unsigned char *)commId.internal;
    shm_name_of(id, c->name, sizeof(c->name));
    size_t ro, so, po;
    c->size = shm_layout(nranks, &ro, &so, &po);

    int64_t next_stale_check = 0;
    for (;;) {
        if (!c->hdr) {
            int rc = comm_open(c, id);
            if (rc < 0) {
                comm_free(c);
                return ncclSystemError;
            }
            if (rc == 0) {
                atomic_store(&c->ranks[rank].pid, (int32_t)getpid());
                atomic_store(&c->ranks[rank].state, R_JOINED);
                next_stale_check = rsim_now_ns() + STALE_CHECK_NS;
            }
        }
        if (c->hdr && all_joined(c))
            break;
        int64_t now = rsim_now_ns();
        if (c->hdr && rank != 0 && now >= next_stale_check) {
            if (comm_replaced(c)) {
                comm_unmap(c);
                continue;
            }
            next_stale_check = now + STALE_CHECK_NS;
        }
        if (rsim_sleep_until(now + INIT_POLL_NS) != 0) {
            if (c->hdr)
                atomic_store(&c->ranks[rank].state, R_NONE);
            comm_free(c);
            return ncclSystemError;
        }
    }
    atomic_store(&c->ranks[rank].state, R_READY);
    *comm = c;
    return ncclSuccess;
}
NCCL_ALIAS(ncclCommInitRank);

RSIM_EXPORT ncclResult_t pncclCommDestroy(ncclComm_t comm) {
    if (!comm_ok(comm))
        return ncclInvalidArgument;
    comm->destroyed = 1;
    atomic_store(&comm->ranks[comm->rank].state, R_DETACHED);
    uint32_t detached = atomic_fetch_add(&comm->hdr->detached, 1) + 1;
    if (comm->rank == 0 || detached == (uint32_t)comm->nranks)
        comm_unlink_if_ours(comm);
    comm_unref(comm); /* pending operations keep it mapped */
    return ncclSuccess;
}
NCCL_ALIAS(ncclCommDestroy);

RSIM_EXPORT ncclResult_t pncclCommAbort(ncclComm_t comm) {
    return pncclCommDestroy(comm); /* nothing is in flight on the host side to abort */
}
NCCL_ALIAS(ncclCommAbort);

RSIM_EXPORT ncclResult_t pncclCommCount(const ncclComm_t comm, int *count) {
    if (!comm_ok(comm) || !count)
        return ncclInvalidArgument;
    *count = comm->nranks;
    return ncclSuccess;
}
NCCL_ALIAS(ncclCommCount);

RSIM_EXPORT ncclResult_t pncclCommUserRank(const ncclComm_t comm, int *rank) {
    if (!comm_ok(comm) || !rank)
        return ncclInvalidArgument;
    *rank = comm->rank;
    return ncclSuccess;
}
NCCL_ALIAS(ncclCommUserRank);

RSIM_EXPORT ncclResult_t pncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                        ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
    ncclResult_t rc = check_collective(comm, sendbuff, recvbuff, count, datatype);
    if (rc != ncclSuccess || (int)op < 0)
        return rc ? rc : ncclInvalidArgument;
    int n = comm->nranks;
    return enqueue(comm, M_COLLECTIVE, -1, (double)count * type_size(datatype), 2.0 * (n - 1) / n, stream);
}
NCCL_ALIAS(ncclAllReduce);

RSIM_EXPORT ncclResult_t pncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
                                        ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
    ncclResult_t rc = check_collective(comm, sendbuff, recvbuff, sendcount, datatype);
    if (rc != ncclSuccess)
        return rc;
    int n = comm->nranks;
    return enqueue(comm, M_COLLECTIVE, -1, (double)sendcount * type_size(datatype) * n, (double)(n - 1) / n,
                   stream);
}
NCCL_ALIAS(ncclAllGather);

RSIM_EXPORT ncclResult_t pncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                                            ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                            cudaStream_t stream) {
    ncclResult_t rc = check_collective(comm, sendbuff, recvbuff, recvcount, datatype);
    if (rc != ncclSuccess || (int)op < 0)
        return rc ? rc : ncclInvalidArgument;
    int n = comm->nranks;
    return enqueue(comm, M_COLLECTIVE, -1, (double)recvcount * type_size(datatype) * n, (double)(n - 1) / n,
                   stream);
}
NCCL_ALIAS(ncclReduceScatter);

RSIM_EXPORT ncclResult_t pncclBroadcast(const void *sendbuff, void *recvbuff, size_t count,
                                        ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream) {
    ncclResult_t rc = check_collective(comm, comm && root == comm->rank ? sendbuff : recvbuff, recvbuff, count,
                                       datatype);
    if (rc != ncclSuccess)
        return rc;
    if (root < 0 || root >= comm->nranks)
        return ncclInvalidArgument;
    return enqueue(comm, M_COLLECTIVE, -1, (double)count * type_size(datatype), 1.0, stream);
}
NCCL_ALIAS(ncclBroadcast);

RSIM_EXPORT ncclResult_t pncclReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                     ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
    ncclResult_t rc = check_collective(comm, sendbuff, comm && root == comm->rank ? recvbuff : sendbuff, count,
                                       datatype);
    if (rc != ncclSuccess || (int)op < 0)
        return rc ? rc : ncclInvalidArgument;
    if (root < 0 || root >= comm->nranks)
        return ncclInvalidArgument;
    return enqueue(comm, M_COLLECTIVE, -1, (double)count * type_size(datatype), 1.0, stream);
}
NCCL_ALIAS(ncclReduce);

RSIM_EXPORT ncclResult_t pncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
                                   ncclComm_t comm, cudaStream_t stream) {
    ncclResult_t rc = check_collective(comm, sendbuff, sendbuff, count, datatype);
    if (rc != ncclSuccess)
        return rc;
    if (peer < 0 || peer >= comm->nranks)
        return ncclInvalidArgument;
    return enqueue(comm, M_SEND, peer, (double)count * type_size(datatype), 1.0, stream);
}
NCCL_ALIAS(ncclSend);

RSIM_EXPORT ncclResult_t pncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer,
                                   ncclComm_t comm, cudaStream_t stream) {
    ncclResult_t rc = check_collective(comm, recvbuff, recvbuff, count, datatype);
    if (rc != ncclSuccess)
        return rc;
    if (peer < 0 || peer >= comm->nranks)
        return ncclInvalidArgument;
    return enqueue(comm, M_RECV, peer, (double)count * type_size(datatype), 1.0, stream);
}
NCCL_ALIAS(ncclRecv);

RSIM_EXPORT ncclResult_t pncclGroupStart(void) {
    group_depth++;
    return ncclSuccess;
}
NCCL_ALIAS(ncclGroupStart);

/* The operations of the outermost group become one stream entry (on the first operation's stream): it
 * completes when every member's peers arrived, plus the members' transfers one after the other. */
RSIM_EXPORT ncclResult_t pncclGroupEnd(void) {
    if (group_depth <= 0)
        return ncclInvalidUsage;
    if (--group_depth > 0 || group_n == 0)
        return ncclSuccess;
    int n = group_n;
    group_n = 0;
    return op_submit(group_members, n, group_stream);
}
NCCL_ALIAS(ncclGroupEnd);

/* ---------------------------------------------------------------- simulator knobs and helpers */

/* Not an NCCL name: this rank's link bandwidth is divided by `factor` (a slow link) for later operations. */
RSIM_EXPORT void rsim_set_link_factor(double factor) {
    if (factor > 0)
        link_factor = factor;
}

RSIM_EXPORT double rsim_get_link_factor(void) { return link_factor; }

/* The shared-memory name of the communicator of a unique id ("/rankscope-sim-<hash>"), for clean-up. */
RSIM_EXPORT int rsim_comm_shm_name(const ncclUniqueId *id, char *out, int len) {
    if (!id || !out || len < 32)
        return -1;
    shm_name_of((const unsigned char *)id->internal, out, (size_t)len);
    return 0;
}
