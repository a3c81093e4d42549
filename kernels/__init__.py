"""Attention backends and (later) Triton kernels. Holds no scheduling logic and never imports `engine`.

    attention/base.py          AttentionBackend interface + registry (lazy imports)
    attention/torch_native.py  the CPU path and the reference every GPU backend is tested against
"""
