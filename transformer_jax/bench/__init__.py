"""Benchmarks (not tests): ``transformer-jax bench {train,decode,memory} ...``.

Each prints what it measured and, where it compares, ratios measured in the same run.
"""
