// See periodic.h.
#define _GNU_SOURCE
#include "periodic.h"

#include <pthread.h>
#include <stdlib.h>
#include <time.h>

uint32_t rankscope_flush_period_ms(void) {
    const char *flush = getenv("RANKSCOPE_SHIM_FLUSH_MS");
    return flush && *flush ? (uint32_t)strtoul(flush, NULL, 10) : DEFAULT_FLUSH_MS;
}

static void *every_period(void *tick) {
    uint32_t ms = rankscope_flush_period_ms();
    if (!ms)
        ms = DEFAULT_FLUSH_MS;
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
    for (;;) {
        nanosleep(&ts, NULL);
        ((void (*)(void))tick)();
    }
    return NULL;
}

int rankscope_every_flush_period(const char *name, void (*tick)(void)) {
    pthread_t t;
    int rc = pthread_create(&t, NULL, every_period, (void *)tick);
    if (rc)
        return rc;
    pthread_setname_np(t, name);
    pthread_detach(t);
    return 0;
}
