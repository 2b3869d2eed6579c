"""Measurement of the workload: one run (run_one), the side-by-side comparison (compare),
the rule check (rules), the report (report) and per-kernel GPU benchmarks (kernels/)."""
