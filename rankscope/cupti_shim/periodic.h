// The library's one clock: both halves (the CUPTI shim and the NCCL profiler plugin) hand over and look at
// their semaphores once a flush period, each from a thread of its own, never from the job's threads.
#ifndef RANKSCOPE_PERIODIC_H
#define RANKSCOPE_PERIODIC_H

#include <stdint.h>

#define DEFAULT_FLUSH_MS 1000

// RANKSCOPE_SHIM_FLUSH_MS as the job set it (0 included: CUPTI then hands over full buffers only), else
// DEFAULT_FLUSH_MS.
uint32_t rankscope_flush_period_ms(void);

// Starts a detached thread named `name` that calls `tick` once a flush period (DEFAULT_FLUSH_MS where the
// period is 0). Returns 0, or pthread_create's error.
int rankscope_every_flush_period(const char *name, void (*tick)(void));

#endif
