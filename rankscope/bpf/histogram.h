// log2 histograms of durations, one layout for every program that keeps one (read back by
// agent/loader/histograms.py).
#ifndef RANKSCOPE_HISTOGRAM_H
#define RANKSCOPE_HISTOGRAM_H

#define HIST_SLOTS 40  // log2(ns) buckets: 1 ns .. ~18 min

// A duration's bucket, floor(log2(ns)); the last bucket also holds everything longer.
static __always_inline u32 hist_slot(u64 ns) {
    u32 slot = bpf_log2l(ns);
    return slot < HIST_SLOTS ? slot : HIST_SLOTS - 1;
}

#endif
