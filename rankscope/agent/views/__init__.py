"""Views of a running job for the engineer who reads a diagnosis next, one module per view or format:
profile.py (a rank's Python stacks over a window, the record every format reads), folded.py, speedscope.py,
pprof.py (with protobuf.py, its wire encoding), dump.py (every thread's stack now)."""
