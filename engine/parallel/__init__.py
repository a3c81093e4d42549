"""Tensor parallelism: one replica's model split over several ranks, one process and one device each.

    shard.py    which heads, MLP columns and vocabulary rows each rank holds; checkpoint slices (pure)
    group.py    TPGroup: a rank's torch.distributed groups (NCCL or gloo for the forward, gloo for control)
    launch.py   rank 0 spawns and watches ranks 1..N-1; the others join
    step.py     rank 0's step (batch layout, table edits, logit rows) broadcast as tensors to the others

Rank 0 is the engine core: its scheduler, radix cache, KV allocator and sampler are the only ones. The
other ranks (engine.runner.follower) hold a shard of the weights and of the KV pool (their heads, the same
slots) and run every forward rank 0 runs, in the same order (docs/engine.md, Tensor parallelism).
"""
