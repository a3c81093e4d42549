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
        """(size, max_context_len) int32, device: what the attention kernels read."""
        self.host = (
            self.req_to_token
            if self.req_to_token.device.type == "cpu"
            else torch.zeros((size, max_context_len), dtype=torch.int32)
        )
        """The same table on the host, written together with it: what the scheduler reads. Reading the
        device table would make the host wait for the batch in flight (overlap scheduling)."""
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
        """Record that positions [start, start + len(slots)) of `row` live at `slots` (host int64: slots
        come from the allocator and the radix cache, both on the host)."""
        if slots.device.type != "cpu":
            raise ValueError("slot indices must be a host tensor (allocator, radix cache)")
        end = start + slots.numel()
        self.host[row, start:end] = slots
        if self.req_to_token is not self.host:
            self.req_to_token[row, start:end] = to_device(slots, self.req_to_token.device, torch.int32)

    def write_positions(self, rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor) -> None:
        """req_to_token[rows[i], cols[i]] = slots[i] (host int64 tensors of one length; a decode step)."""
        self.host[rows, cols] = slots.to(torch.int32)
        if self.req_to_token is not self.host:
            rows_cols_slots = to_device(torch.stack([rows, cols, slots]), self.req_to_token.device)  # one copy
            self.req_to_token[rows_cols_slots[0], rows_cols_slots[1]] = rows_cols_slots[2].to(torch.int32)

    def read(self, row: int, length: int) -> torch.Tensor:
        """(length,) int64, host — slots of positions [0, length) of `row`."""
        return self.host[row, :length].to(torch.int64)


class RecordingReqToTokenPool(ReqToTokenPool):
    """Rank 0's table when tensor-parallel: every write is also recorded, so that the other ranks, which keep
    copies of the table for their attention kernels, replay it before running the step that reads it."""

    def __init__(self, size: int, max_context_len: int, device: torch.device):
        super().__init__(size, max_context_len, device)
        self._edits: List[torch.Tensor] = []

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        super().write(row, start, slots)
        n = slots.numel()
        cols = torch.arange(start, start + n, dtype=torch.int64)
        self._edits.append(torch.stack([torch.full((n,), row, dtype=torch.int64), cols, slots.to(torch.int64)]))

    def write_positions(self, rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor) -> None:
        super().write_positions(rows, cols, slots)
        self._edits.append(torch.stack([rows, cols, slots]).to(torch.int64))

    def take_edits(self) -> torch.Tensor:
        """(3, E) int64, host — rows, columns and slots written since the last call, one entry per cell (its
        last value), for `write_positions` on another copy of the table."""
        if not self._edits:
            return torch.empty((3, 0), dtype=torch.int64)
        edits = torch.cat(self._edits, dim=1)
        self._edits = []
        cells, inverse = torch.unique(edits[0] * self.max_context_len + edits[1], return_inverse=True)
        order = torch.arange(edits.shape[1], dtype=torch.int64)
        last = torch.full((cells.numel(),), -1, dtype=torch.int64).scatter_reduce_(0, inverse, order, "amax")
        return edits[:, last]
