"""Benchmark runner for detlogp-jax (`python -m benchmarks.run --help`)."""
