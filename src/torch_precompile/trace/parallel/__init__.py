"""Parallelism in a capture: DTensors (tensor parallelism), DistributedDataParallel and FSDP2
(``fully_shard``), their communication traced into the graph."""
