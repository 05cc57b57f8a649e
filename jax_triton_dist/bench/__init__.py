"""Benchmarks: ``python -m jax_triton_dist.bench <suite>`` prints a table and writes JSON."""
