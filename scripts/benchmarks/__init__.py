"""rankscope's benchmarks (scripts/bench.py is their command line): one module per benchmark, each with
run(ctx) -> (rows, details), and harness.py, what they share."""
