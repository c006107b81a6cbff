"""The benchmarks' helpers and scripts, without timing."""
