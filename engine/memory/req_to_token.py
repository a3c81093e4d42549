"""ReqToTokenPool: request slot → KV slot of each of its positions.

req_to_token[r, p] is the KV slot holding position p of the request in row r,
valid for p < that request's kv_len. Rows are handed out per running request
and returned when it finishes, is retracted or aborted.
"""
from __future__ import annotations

from typing import List

import torch

from engine.device_copy import to_device


class ReqToTokenPool:
    def __init__(self, size: int, max_context_len: int, device: torch.device):
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=device)
        """(size, max_context_len) int32, device."""
        self._free_rows: List[int] = list(range(size - 1, -1, -1))

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int:
        """A free row; the caller has checked available_size()."""
        if not self._free_rows:
            raise RuntimeError("ReqToTokenPool is full")
        return self._free_rows.pop()

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Record that positions [start, start + len(slots)) of `row` live at `slots`."""
        if slots.device.type == "cpu":
            slots = to_device(slots, self.req_to_token.device, torch.int32)
        self.req_to_token[row, start:start + slots.numel()] = slots.to(torch.int32)

    def read(self, row: int, length: int) -> torch.Tensor:
        """(length,) int64 — slots of positions [0, length) of `row`."""
        return self.req_to_token[row, :length].to(torch.int64)
