// Test driver for the CUPTI shim without a GPU: loads the shim, calls its InitializeInjection (which finds
// no driver), then feeds its completed-buffer path a buffer of real CUPTI record structs, on command.
// stdin commands, each after the shim's launch-semaphore check and answered by "stats EMITTED DROPPED SKIPPED LAUNCHES
// LAUNCHES_DROPPED API_WANTED API_FAILURES HANDOVERS" (HANDOVERS: the uprobe traps the shim fired):
//   "emit N"   -> process the activity buffer (a kernel, a memcpy, a memset) N times;
//   "now"      -> process it once with its times moved to end now on CLOCK_REALTIME (CUPTI's clock), as a
//                 buffer of work that just ran;
//   "many N"   -> process one buffer of N kernel records (N <= MANY_MAX), the i-th from MANY_START + i us for
//                 MANY_NS, correlation 9000 + i;
//   "launch I" -> process launch buffer I: 0 a kernel whose launch comes later, 1 the API records (a runtime
//                 launch with its nested driver launch, another runtime launch, a memcpy call), 2 the kernel of
//                 the second launch. See LAUNCH_* for the times.
// First output line: "init RC BUFFER_ADDRESS NAME_ADDRESS".
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cupti.h>

// The kernel record CUPTI of these headers' release writes (CUDA 13.0 appended fields under a new name).
#if CUPTI_API_VERSION >= 130000
typedef CUpti_ActivityKernel10 kernel_record;
#else
typedef CUpti_ActivityKernel9 kernel_record;
#endif

struct shim_stats {
    uint64_t emitted, dropped, skipped_buffers, cupti_dropped, launches, launches_dropped, api_wanted, api_failures,
        handovers;
};

static const char kernel_name[] = "_Z9gemm_tileILi128EEvPKfS1_Pf";

// Launch 7001's driver call ends at LAUNCH_END_A (its record comes first, as CUPTI writes it when the call
// returns, inside the runtime call), its kernel starts 5 us later; launch 7002 ends at LAUNCH_END_B, its
// kernel starts 2 ms later.
#define LAUNCH_END_A 2000000010000ull
#define LAUNCH_END_B 2000000020000ull

static size_t put_api(uint8_t *buffer, size_t used, CUpti_ActivityKind kind, uint32_t cbid, uint32_t correlation,
                      uint64_t start, uint64_t end) {
    CUpti_ActivityAPI *a = (void *)(buffer + used);
    a->kind = kind;
    a->cbid = cbid;
    a->start = start;
    a->end = end;
    a->processId = 1;
    a->threadId = 77;
    a->correlationId = correlation;
    return used + sizeof(*a);
}

#define MANY_MAX 4096
#define MANY_START 3000000000000ull
#define MANY_NS 500

static size_t put_kernel(uint8_t *buffer, size_t used, uint32_t correlation, uint64_t start) {
    kernel_record *k = (void *)(buffer + used);
    k->kind = CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL;
    k->start = start;
    k->end = start + 30000;
    k->deviceId = 0;
    k->streamId = 7;
    k->correlationId = correlation;
    k->name = kernel_name;
    return used + sizeof(*k);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s SHIM.so\n", argv[0]);
        return 2;
    }
    void *shim = dlopen(argv[1], RTLD_NOW);
    if (!shim) {
        fprintf(stderr, "%s\n", dlerror());
        return 1;
    }
    int (*init)(void) = dlsym(shim, "InitializeInjection");
    void (*process)(uint8_t *, size_t) = dlsym(shim, "rankscope_shim_process_buffer");
    void (*follow)(void) = dlsym(shim, "rankscope_shim_follow_launch_semaphore");
    void (*get_stats)(struct shim_stats *) = dlsym(shim, "rankscope_shim_stats");

    static uint8_t buffer[4096] __attribute__((aligned(8)));
    size_t used = 0;
    kernel_record *k = (void *)(buffer + used);
    k->kind = CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL;
    k->start = 1000000000123ull;
    k->end = 1000000250456ull;
    k->deviceId = 3;
    k->streamId = 17;
    k->correlationId = 4242;
    k->name = kernel_name;
    used += sizeof(*k);
    CUpti_ActivityMemcpy6 *c = (void *)(buffer + used);
    c->kind = CUPTI_ACTIVITY_KIND_MEMCPY;
    c->start = 1000000300000ull;
    c->end = 1000000340000ull;
    c->deviceId = 3;
    c->streamId = 18;
    c->correlationId = 4243;
    c->bytes = 1 << 20;
    used += sizeof(*c);
    CUpti_ActivityMemset4 *s = (void *)(buffer + used);
    s->kind = CUPTI_ACTIVITY_KIND_MEMSET;
    s->start = 1000000400000ull;
    s->end = 1000000401000ull;
    s->deviceId = 3;
    s->streamId = 17;
    s->correlationId = 4244;
    s->bytes = 4096;
    used += sizeof(*s);

    static uint8_t launch_buffers[3][4096] __attribute__((aligned(8)));
    size_t launch_used[3];
    launch_used[0] = put_kernel(launch_buffers[0], 0, 7001, LAUNCH_END_A + 5000);
    size_t n_api = put_api(launch_buffers[1], 0, CUPTI_ACTIVITY_KIND_DRIVER, CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel,
                           7001, LAUNCH_END_A - 8000, LAUNCH_END_A);
    n_api = put_api(launch_buffers[1], n_api, CUPTI_ACTIVITY_KIND_RUNTIME, CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000,
                    7001, LAUNCH_END_A - 9000, LAUNCH_END_A + 1000);
    n_api = put_api(launch_buffers[1], n_api, CUPTI_ACTIVITY_KIND_RUNTIME, CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy_v3020,
                    7003, LAUNCH_END_A + 1000, LAUNCH_END_A + 4000);
    launch_used[1] = put_api(launch_buffers[1], n_api, CUPTI_ACTIVITY_KIND_RUNTIME,
                             CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000, 7002, LAUNCH_END_B - 6000, LAUNCH_END_B);
    launch_used[2] = put_kernel(launch_buffers[2], 0, 7002, LAUNCH_END_B + 2000000);

    printf("init %d %p %p\n", init(), (void *)buffer, (void *)kernel_name);
    fflush(stdout);
    char line[64];
    while (fgets(line, sizeof(line), stdin)) {
        int n = 0;
        follow();  // the shim's watcher thread (not started without a driver) ticks before each buffer
        if (sscanf(line, "emit %d", &n) == 1) {
            for (int i = 0; i < n; i++)
                process(buffer, used);
        } else if (strncmp(line, "now", 3) == 0) {
            static uint8_t shifted[4096] __attribute__((aligned(8)));
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            uint64_t shift = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec - s->end;
            memcpy(shifted, buffer, used);
            ((kernel_record *)shifted)->start += shift;
            ((kernel_record *)shifted)->end += shift;
            CUpti_ActivityMemcpy6 *cs = (void *)(shifted + ((uint8_t *)c - buffer));
            cs->start += shift;
            cs->end += shift;
            CUpti_ActivityMemset4 *ss = (void *)(shifted + ((uint8_t *)s - buffer));
            ss->start += shift;
            ss->end += shift;
            process(shifted, used);
        } else if (sscanf(line, "many %d", &n) == 1 && n > 0 && n <= MANY_MAX) {
            static uint8_t many[MANY_MAX * sizeof(kernel_record)] __attribute__((aligned(8)));
            size_t filled = 0;
            for (int i = 0; i < n; i++) {
                kernel_record *m = (void *)(many + filled);
                filled = put_kernel(many, filled, 9000 + i, MANY_START + (uint64_t)i * 1000);
                m->end = m->start + MANY_NS;
            }
            process(many, filled);
        } else if (sscanf(line, "launch %d", &n) == 1 && n >= 0 && n < 3) {
            process(launch_buffers[n], launch_used[n]);
        } else {
            continue;
        }
        struct shim_stats st;
        get_stats(&st);
        printf("stats %lu %lu %lu %lu %lu %lu %lu %lu\n", st.emitted, st.dropped, st.skipped_buffers, st.launches,
               st.launches_dropped, st.api_wanted, st.api_failures, st.handovers);
        fflush(stdout);
    }
    return 0;
}
