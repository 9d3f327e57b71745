// A process for tests/system/test_inject.py to load libraries into, checking from inside that it was put back
// exactly as it was interrupted:
//   spin: the main thread computes in registers only (a double in an SSE register, a counter in a general
//         one) and checks them every iteration; a register not restored prints "corrupt" and exits 3.
//         SIGUSR1 ends the loop: "stopped N" (N iterations), exit 0.
//   read: the main thread blocks in read(2) on stdin (a restarting system call); each line read is answered
//         "ok LINE"; a read that returns anything but data or end of file prints "bad read" and exits 3.
//   epoll: the same, blocked in epoll_wait(2) on stdin first (a call a stop ends with EINTR): "bad epoll"
//         and exit 3 if it returns anything but a ready stdin.
// Built with -shared -fPIC -DLIBRARY instead: a library to load, exporting entry() (returns 42).
#include <errno.h>
#include <sys/epoll.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#ifdef LIBRARY
// Loaded by the tests: EXIT_IN_CONSTRUCTOR kills its own process while dlopen runs (a process that exits
// mid-injection); SLEEP_IN_CONSTRUCTOR outlasts the injector's deadline; NEEDS_MISSING_SYMBOL cannot load.
__attribute__((constructor)) static void loaded(void) {
#ifdef EXIT_IN_CONSTRUCTOR
    kill(getpid(), SIGKILL);
    pause();
#endif
#ifdef SLEEP_IN_CONSTRUCTOR
    sleep(SLEEP_IN_CONSTRUCTOR);
#endif
}

#ifdef NEEDS_MISSING_SYMBOL
void rankscope_no_such_function(void);  // defined nowhere: dlopen(RTLD_NOW) refuses the library
int entry(void) { rankscope_no_such_function(); return 42; }
#else
int entry(void) { return 42; }
#endif
#else
static volatile sig_atomic_t stop_requested;

static void request_stop(int sig) {
    (void)sig;
    stop_requested = 1;
}

static int spin(void) {
    double sum = 0.0;
    unsigned long i = 0;
    signal(SIGUSR1, request_stop);
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("ready\n");
    while (!stop_requested) {
        sum += 1.0;
        i++;
        if (sum != (double)i) {
            printf("corrupt %lu %f\n", i, sum);
            return 3;
        }
    }
    printf("stopped %lu\n", i);
    return 0;
}

static int echo(int use_epoll) {
    char line[256];
    size_t have = 0;
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = 0};
    epoll_ctl(ep, EPOLL_CTL_ADD, 0, &ev);
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("ready\n");
    for (;;) {
        if (use_epoll && have == 0) {
            int ready = epoll_wait(ep, &ev, 1, -1);
            if (ready != 1) {
                printf("bad epoll %d %s\n", ready, strerror(errno));
                return 3;
            }
        }
        ssize_t n = read(0, line + have, 1);
        if (n == 0)
            return 0;
        if (n != 1) {
            printf("bad read %zd %s\n", n, strerror(errno));
            return 3;
        }
        if (line[have] == '\n' || have == sizeof(line) - 2) {
            line[have] = 0;
            printf("ok %s\n", line);
            have = 0;
        } else {
            have++;
        }
    }
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "spin") == 0)
        return spin();
    return echo(argc > 1 && strcmp(argv[1], "epoll") == 0);
}
#endif
