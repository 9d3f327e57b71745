/* Load generators of the benchmark suite (scripts/bench.py compiles this with gcc at run time).
 *
 *   bench_storm launch LIBCUDA      a kernel-launch storm through LIBCUDA (the stand-in libcuda.so.1, dlopen()ed)
 *   bench_storm switch LIBCUDA CPU  a context-switch storm: two processes pinned to CPU ping-pong a byte over
 *                                   pipes (LIBCUDA is only mapped, so that the agent can watch them)
 *
 * Both print "ready PID [CHILD_PID]" once set up, then run commands read one per line on stdin, answering
 * each with one line "done WALL_NS CPU_NS" (CPU_NS: this process's CPU time, user + system, which is where
 * the kernel charges uprobe handling):
 *
 *   free N          N cuLaunchKernel calls as fast as possible (cuStreamSynchronize every 1000)
 *   work N SPIN     N iterations of SPIN units of busy work then one cuLaunchKernel (a launcher paced by work)
 *   spin N SPIN     the same busy work without launches (calibration)
 *   paced RATE S    RATE launches a second for S seconds, time-paced: every 10 ms a burst of RATE/100 launches
 *                   and one cuStreamSynchronize, then a sleep to the next tick (a busy node's rank, not a
 *                   CPU hog: 64 of them fit on 2 cores)
 *   pingpong N      N round trips parent -> child -> parent (switch mode)
 *   quit
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef void *CUstream;
typedef void *CUfunction;
typedef void *CUmodule;
typedef void *CUcontext;

static CUresult (*cuInit)(unsigned);
static CUresult (*cuDeviceGet)(int *, int);
static CUresult (*cuCtxCreate_v2)(CUcontext *, unsigned, int);
static CUresult (*cuStreamCreate)(CUstream *, unsigned);
static CUresult (*cuStreamSynchronize)(CUstream);
static CUresult (*cuModuleLoadData)(CUmodule *, const void *);
static CUresult (*cuModuleGetFunction)(CUfunction *, CUmodule, const char *);
static CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                  CUstream, void **, void **);

static CUstream stream;
static CUfunction kernel;
static void *params[1];
static volatile uint64_t sink;

#define SYNC_EVERY 1000

static void die(const char *what) {
    fprintf(stderr, "bench_storm: %s\n", what);
    exit(2);
}

static int64_t clock_ns(clockid_t id) {
    struct timespec ts;
    clock_gettime(id, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void *sym(void *lib, const char *name) {
    void *p = dlsym(lib, name);
    if (!p) {
        fprintf(stderr, "bench_storm: %s not found: %s\n", name, dlerror());
        exit(2);
    }
    return p;
}

static void *open_lib(const char *path) {
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "bench_storm: cannot load %s: %s\n", path, dlerror());
        exit(2);
    }
    return lib;
}

static void check(CUresult rc, const char *what) {
    if (rc != 0) {
        fprintf(stderr, "bench_storm: %s failed: CUresult %d\n", what, rc);
        exit(2);
    }
}

static void setup_cuda(const char *path) {
    void *lib = open_lib(path);
    cuInit = sym(lib, "cuInit");
    cuDeviceGet = sym(lib, "cuDeviceGet");
    cuCtxCreate_v2 = sym(lib, "cuCtxCreate_v2");
    cuStreamCreate = sym(lib, "cuStreamCreate");
    cuStreamSynchronize = sym(lib, "cuStreamSynchronize");
    cuModuleLoadData = sym(lib, "cuModuleLoadData");
    cuModuleGetFunction = sym(lib, "cuModuleGetFunction");
    cuLaunchKernel = sym(lib, "cuLaunchKernel");
    int dev;
    CUcontext ctx;
    CUmodule mod;
    static const char image[] = "\x7f" "ELF bench_storm stand-in cubin";
    check(cuInit(0), "cuInit");
    check(cuDeviceGet(&dev, 0), "cuDeviceGet");
    check(cuCtxCreate_v2(&ctx, 0, dev), "cuCtxCreate_v2");
    check(cuStreamCreate(&stream, 1), "cuStreamCreate");
    check(cuModuleLoadData(&mod, image), "cuModuleLoadData");
    check(cuModuleGetFunction(&kernel, mod, "bench_storm_kernel"), "cuModuleGetFunction");
}

/* SPIN units of dependent integer work the compiler cannot remove (about a nanosecond each). */
static inline void spin(long units) {
    uint64_t x = sink;
    for (long k = 0; k < units; k++) {
        x = x * 6364136223846793005ULL + 1442695040888963407ULL;
        __asm__ volatile("" : "+r"(x));
    }
    sink = x;
}

/* N launches of a 1-thread kernel (1 ns of simulated GPU time), each after SPIN units of work (0: none). */
static void launches(long n, long units) {
    for (long i = 0; i < n; i++) {
        if (units)
            spin(units);
        check(cuLaunchKernel(kernel, 1, 1, 1, 1, 1, 1, 0, stream, params, NULL), "cuLaunchKernel");
        if ((i + 1) % SYNC_EVERY == 0)
            check(cuStreamSynchronize(stream), "cuStreamSynchronize");
    }
    check(cuStreamSynchronize(stream), "cuStreamSynchronize");
}

#define PACE_HZ 100

/* Bursts on an absolute 10 ms beat: a late burst (a busy CPU) is caught up at once, so that exactly
 * RATE * S / 100 * 100 launches are issued whatever the scheduling. */
static void paced(long rate, long seconds) {
    struct timespec tick;
    clock_gettime(CLOCK_MONOTONIC, &tick);
    long per_burst = rate / PACE_HZ;
    for (long b = 0; b < seconds * PACE_HZ; b++) {
        for (long i = 0; i < per_burst; i++)
            check(cuLaunchKernel(kernel, 1, 1, 1, 1, 1, 1, 0, stream, params, NULL), "cuLaunchKernel");
        check(cuStreamSynchronize(stream), "cuStreamSynchronize");
        tick.tv_nsec += 1000000000L / PACE_HZ;
        if (tick.tv_nsec >= 1000000000L) {
            tick.tv_nsec -= 1000000000L;
            tick.tv_sec++;
        }
        clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &tick, NULL);
    }
}

static void pin(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (sched_setaffinity(0, sizeof(set), &set) != 0)
        die("cannot pin to the CPU");
}

static int to_child = -1, from_child = -1;

static void pingpong(long n) {
    char b = 'p';
    for (long i = 0; i < n; i++) {
        if (write(to_child, &b, 1) != 1 || read(from_child, &b, 1) != 1)
            die("pipe to the child broke");
    }
}

static pid_t start_child(int cpu) {
    int down[2], up[2];
    if (pipe(down) || pipe(up))
        die("pipe failed");
    pid_t child = fork();
    if (child < 0)
        die("fork failed");
    if (child == 0) {
        pin(cpu);
        close(down[1]);
        close(up[0]);
        char b;
        while (read(down[0], &b, 1) == 1 && b != 'q') {
            if (write(up[1], &b, 1) != 1)
                break;
        }
        _exit(0);
    }
    close(down[0]);
    close(up[1]);
    to_child = down[1];
    from_child = up[0];
    pin(cpu);
    return child;
}

int main(int argc, char **argv) {
    if (argc < 3 || (strcmp(argv[1], "launch") != 0 && strcmp(argv[1], "switch") != 0) ||
        (strcmp(argv[1], "switch") == 0 && argc < 4)) {
        fprintf(stderr, "usage: %s launch LIBCUDA | switch LIBCUDA CPU\n", argv[0]);
        return 2;
    }
    int switching = strcmp(argv[1], "switch") == 0;
    pid_t child = 0;
    if (switching) {
        open_lib(argv[2]); /* mapped in both processes: what makes them watchable training processes */
        child = start_child(atoi(argv[3]));
        printf("ready %d %d\n", (int)getpid(), (int)child);
    } else {
        setup_cuda(argv[2]);
        printf("ready %d\n", (int)getpid());
    }
    fflush(stdout);

    char line[256], cmd[32];
    while (fgets(line, sizeof(line), stdin)) {
        long n = 0, units = 0;
        int fields = sscanf(line, "%31s %ld %ld", cmd, &n, &units);
        if (fields < 1)
            continue;
        if (strcmp(cmd, "quit") == 0)
            break;
        int64_t w0 = clock_ns(CLOCK_MONOTONIC), c0 = clock_ns(CLOCK_PROCESS_CPUTIME_ID);
        if (!switching && strcmp(cmd, "free") == 0 && fields >= 2)
            launches(n, 0);
        else if (!switching && strcmp(cmd, "work") == 0 && fields == 3 && units > 0)
            launches(n, units);
        else if (!switching && strcmp(cmd, "paced") == 0 && fields == 3 && n >= PACE_HZ && units > 0)
            paced(n, units);
        else if (strcmp(cmd, "spin") == 0 && fields == 3)
            for (long i = 0; i < n; i++)
                spin(units);
        else if (switching && strcmp(cmd, "pingpong") == 0 && fields >= 2)
            pingpong(n);
        else {
            printf("error unknown command: %s", line);
            fflush(stdout);
            continue;
        }
        int64_t w1 = clock_ns(CLOCK_MONOTONIC), c1 = clock_ns(CLOCK_PROCESS_CPUTIME_ID);
        printf("done %lld %lld\n", (long long)(w1 - w0), (long long)(c1 - c0));
        fflush(stdout);
    }
    if (child > 0) {
        char q = 'q';
        if (write(to_child, &q, 1) != 1)
            kill(child, SIGKILL);
        waitpid(child, NULL, 0);
    }
    return 0;
}
