"""Pure analysis: rank patterns in, findings out (no I/O, no clocks)."""
