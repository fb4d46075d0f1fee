"""The benchmark suite: ``python -m bench`` (``make bench``). See docs/benchmarks.md and bench/PERF-NOTES.md."""
