/* rankscope simulator: the interface between the stand-in libcuda.so.1 (which owns the stream timelines)
 * and the stand-in libnccl.so.2 (which owns communicators and the cross-process rendezvous).
 *
 * Time is CLOCK_MONOTONIC in nanoseconds, shared by every process of the host.
 * A stream is a timeline: `tail` is when its resolved work ends; entries whose end is not known yet
 * (collectives waiting for peers) stay queued and are resolved lazily, in order.
 * None of the rsim_* names is a CUDA or NCCL name. */
#ifndef RANKSCOPE_RSIM_H
#define RANKSCOPE_RSIM_H

#include <stdint.h>

#define RSIM_EXPORT __attribute__((noinline, used, visibility("default")))

typedef struct CUstream_st *CUstream; /* also NCCL's cudaStream_t */

/* How a pending external entry (a collective) tells the stream what to wait on. The poll that fills it
 * takes a reference on `obj`; the waiter calls wait() (blocks a bounded time or until progress may have
 * been made; returns -1 when interrupted by a signal and the library is interruptible), then unref(). */
typedef struct rsim_waiter {
    int (*wait)(void *obj, uint32_t token);
    void (*unref)(void *obj);
    void *obj;
    uint32_t token;
} rsim_waiter;

typedef struct rsim_ext_ops {
    /* start: when the entry starts on the stream (max(previous end, enqueue time)), the same on every call.
     * Returns the entry's end time, or -1 while unknown (then fills *w if w is not NULL). */
    int64_t (*poll)(void *ctx, int64_t start, rsim_waiter *w);
    /* Called once, after poll returned an end time or when the entry is dropped. */
    void (*release)(void *ctx);
} rsim_ext_ops;

/* Exported by libcuda.so.1 for libnccl.so.2. */
int64_t rsim_now_ns(void);
/* Appends an external entry to a stream's queue (NULL: the default stream); never blocks. 0 on success. */
int rsim_stream_enqueue_external(CUstream stream, const rsim_ext_ops *ops, void *ctx);
/* Whether blocking waits give up (returning an error) when a signal handler interrupts them. */
int rsim_interruptible(void);
/* Whether a signal arrived that should end blocking waits (see rsim_set_interrupt_fd). */
int rsim_interrupt_pending(void);
/* Sleeps until `deadline` (absolute CLOCK_MONOTONIC ns). 0 when reached, -1 when interrupted. */
int rsim_sleep_until(int64_t deadline);

#endif
