"""Parallelism: the device mesh, logical-axis sharding rules, multi-host set-up, context
parallelism, and TPU pods and collectives without a TPU."""
