"""Benchmarks the way the paper measures: a real-shape checkpoint and a same-session A/B harness."""
