"""Tensor parallelism: one replica's model split over several ranks.

    shard.py    which heads, MLP columns and vocabulary rows each rank holds; checkpoint slices (pure)
"""
