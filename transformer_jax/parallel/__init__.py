"""Parallelism: the device mesh (data, fsdp, tensor), logical-axis sharding rules, multi-host.

``mesh`` (the mesh and the CPU devices a host is split into), ``sharding`` (logical-axis rules,
shardings of parameters, optimizer state and batches) and ``distributed`` (``jax.distributed``
start-up across hosts).
"""
