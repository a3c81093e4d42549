"""Pool sizing (docs/scaling.md). No imports here: Serve's controller imports scaling.policy.

loop.py     PoolScaler: runs in the Router replica; signals, operator settings, drains
policy.py   PoolController (the decision) and FollowPoolTarget (Serve's custom autoscaling policy)
models.py   the admin API's request and response models
"""
