// Test driver for the CUPTI shim without a GPU: loads the shim, calls its InitializeInjection (which finds
// no driver), then feeds its completed-buffer path a buffer of real CUPTI record structs, on command.
// stdin commands: "emit N" -> process the buffer N times, then print "stats EMITTED DROPPED SKIPPED".
// First output line: "init RC BUFFER_ADDRESS NAME_ADDRESS".
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cupti.h>

struct shim_stats {
    uint64_t emitted, dropped, skipped_buffers, cupti_dropped;
};

static const char kernel_name[] = "_Z9gemm_tileILi128EEvPKfS1_Pf";

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
    void (*get_stats)(struct shim_stats *) = dlsym(shim, "rankscope_shim_stats");

    static uint8_t buffer[4096] __attribute__((aligned(8)));
    size_t used = 0;
    CUpti_ActivityKernel9 *k = (void *)(buffer + used);
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

    printf("init %d %p %p\n", init(), (void *)buffer, (void *)kernel_name);
    fflush(stdout);
    char line[64];
    while (fgets(line, sizeof(line), stdin)) {
        int n = 0;
        if (sscanf(line, "emit %d", &n) != 1)
            continue;
        for (int i = 0; i < n; i++)
            process(buffer, used);
        struct shim_stats st;
        get_stats(&st);
        printf("stats %lu %lu %lu\n", st.emitted, st.dropped, st.skipped_buffers);
        fflush(stdout);
    }
    return 0;
}
