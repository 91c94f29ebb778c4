"""Parallelism: the rank grid (mesh.py) and tensor + sequence parallelism (tensor.py, vocab.py,
comm.py, sharding.py, grads.py, random.py, checkpointing.py). See docs/parallelism.md."""
