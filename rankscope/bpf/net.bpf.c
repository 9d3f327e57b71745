// TCP sockets of watched processes: the kernel's own accounting of each connection (bytes acknowledged
// and received, the chrono timers of tcp_info: how long the socket was busy sending, limited by the send
// buffer, or limited by the receiver's window; segments retransmitted; smoothed and minimum round trip),
// read from the socket whenever a watched thread sends or receives on it. gloo, and NCCL's socket transport, move tensors over such connections, so a rank whose
// link is slow shows as bytes moving slowly while its sockets had data to send.
//
// Tracepoints, not kprobes: they need no kprobe support in the kernel (this project's hosts have none).
// No kernel headers either: every field is read at the offset the running kernel's BTF gives, passed in as
// -D defines by agent/sources/probes/net.py (SK_*: struct sock_common; TP_*: struct tcp_sock).
#include "common.h"

#define IPPROTO_TCP_ 6
#define AF_INET6_ 10

struct tcp_key {
    u32 pid;
    u32 pad;
    u64 sk;  // the socket's kernel address: unique while it lives
};
struct tcp_val {
    u8 local[16];   // IPv6, or IPv4 as ::ffff:a.b.c.d
    u8 remote[16];
    u16 local_port;
    u16 remote_port;
    u32 srtt_us;    // smoothed round trip, << 3 as the kernel keeps it
    u32 min_rtt_us; // the connection's minimum round trip (windowed min filter): the path without queues
    u32 pad2;
    u64 sends;      // send calls seen
    u64 now[6];     // acked bytes, received bytes, busy, rwnd-limited, sndbuf-limited jiffies, segments
                    // retransmitted: latest
    u64 base[6];    // the same at first sight, so a window counts only what it saw
};
BPF_TABLE("lru_hash", struct tcp_key, struct tcp_val, tcp_socks, 4096);

static __always_inline void read_addr(u8 *out, void *sk, u16 family, u32 v4_off, u32 v6_off) {
    if (family == AF_INET6_) {
        bpf_probe_read_kernel(out, 16, sk + v6_off);
        return;
    }
    __builtin_memset(out, 0, 10);
    out[10] = 0xff;
    out[11] = 0xff;
    bpf_probe_read_kernel(out + 12, 4, sk + v4_off);
}

// The counters now. A chrono period under way is not in chrono_stat until it ends: add it, as tcp_info does.
static __always_inline void read_counters(void *sk, u64 *out) {
    u64 acked = 0, received = 0;
    u32 start = 0, stat[3] = {}, retrans = 0;
    u8 type_byte = 0;
    bpf_probe_read_kernel(&acked, sizeof(acked), sk + TP_BYTES_ACKED);
    bpf_probe_read_kernel(&received, sizeof(received), sk + TP_BYTES_RECEIVED);
    bpf_probe_read_kernel(&start, sizeof(start), sk + TP_CHRONO_START);
    bpf_probe_read_kernel(stat, sizeof(stat), sk + TP_CHRONO_STAT);
    bpf_probe_read_kernel(&type_byte, 1, sk + TP_CHRONO_TYPE_BIT / 8);
    bpf_probe_read_kernel(&retrans, sizeof(retrans), sk + TP_TOTAL_RETRANS);
    u32 type = (type_byte >> (TP_CHRONO_TYPE_BIT % 8)) & 3;
    u32 ongoing = (u32)bpf_jiffies64() - start;
    switch (type) {  // 0: no period under way
    case 1: stat[0] += ongoing; break;
    case 2: stat[1] += ongoing; break;
    case 3: stat[2] += ongoing; break;
    }
    out[0] = acked;
    out[1] = received;
    out[2] = stat[0];
    out[3] = stat[1];
    out[4] = stat[2];
    out[5] = retrans;
}

static __always_inline int on_tcp_io(void *sk, u16 family, u16 protocol, int ret, bool send) {
    if (protocol != IPPROTO_TCP_ || ret <= 0)
        return 0;
    if (!watched_proc())
        return 0;
    struct tcp_key key = {.pid = bpf_get_current_pid_tgid() >> 32, .sk = (u64)sk};
    struct tcp_val *v = tcp_socks.lookup(&key);
    if (!v) {
        struct tcp_val init = {};
        read_addr(init.local, sk, family, SK_RCV_SADDR, SK_V6_RCV_SADDR);
        read_addr(init.remote, sk, family, SK_DADDR, SK_V6_DADDR);
        u16 dport = 0;
        bpf_probe_read_kernel(&dport, sizeof(dport), sk + SK_DPORT);
        bpf_probe_read_kernel(&init.local_port, sizeof(init.local_port), sk + SK_NUM);
        init.remote_port = (dport >> 8) | (dport << 8);  // network order in the socket
        read_counters(sk, init.base);
        tcp_socks.update(&key, &init);
        v = tcp_socks.lookup(&key);
        if (!v)
            return 0;
    }
    // Racing updates from two threads on one socket only ever write values the socket held.
    read_counters(sk, v->now);
    bpf_probe_read_kernel(&v->srtt_us, sizeof(v->srtt_us), sk + TP_SRTT_US);
    bpf_probe_read_kernel(&v->min_rtt_us, sizeof(v->min_rtt_us), sk + TP_MIN_RTT_US);
    if (send)
        __sync_fetch_and_add(&v->sends, 1);
    return 0;
}

// sock_send_length / sock_recv_length(struct sock *sk, int ret, int flags), as raw tracepoints: removing one
// does not wait for a grace period under the kernel's event lock, as a perf-event tracepoint's removal does.
// The family and protocol the classic tracepoint reports are the socket's own, read here.
static __always_inline int on_raw_tcp_io(struct bpf_raw_tracepoint_args *ctx, bool send) {
    void *sk = (void *)ctx->args[0];
    u16 family = 0, protocol = 0;
    bpf_probe_read_kernel(&family, sizeof(family), sk + SK_FAMILY);
    bpf_probe_read_kernel(&protocol, sizeof(protocol), sk + SK_PROTOCOL);
    return on_tcp_io(sk, family, protocol, (int)ctx->args[1], send);
}

RAW_TRACEPOINT_PROBE(sock_send_length) { return on_raw_tcp_io(ctx, true); }
RAW_TRACEPOINT_PROBE(sock_recv_length) { return on_raw_tcp_io(ctx, false); }
