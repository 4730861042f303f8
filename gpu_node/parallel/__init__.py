"""Parallelism inside a node, on torch.distributed: the process group (group.py), a model's
tensor-parallel shard (sharding.py, layers.py) and the step that rank 0 broadcasts to the
other ranks (step.py, worker.py)."""
