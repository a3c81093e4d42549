"""Attention backends behind one interface; see base.py for the contract."""

from kernels.attention.base import AttentionBackend, available_backends, get_backend_class, register_backend  # noqa: F401
