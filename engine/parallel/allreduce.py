"""PeerAllReduce: small all-reduces over peer memory (NVLink), for the collectives of decode steps.

A batch-1 decode step of a tensor-parallel Llama all-reduces two (bs, hidden) tensors per layer: a few KB
each. NCCL's ring and tree algorithms pay a fixed latency per call that, at these sizes, is larger than the
transfer. torch's symmetric memory (`torch.distributed._symmetric_memory`) maps one buffer of every rank
into every rank's address space and ships the kernels that read the peers' buffers directly:

    one-shot   every rank reads all ranks' inputs and sums them: one barrier, (size - 1) x bytes read per
               rank; the fastest for small tensors
    two-shot   a reduce-scatter then an all-gather through the same buffers: less traffic per rank, a
               second barrier; better for mid-sized tensors

Ownership: one buffer of BUFFER_BYTES per rank, allocated and exchanged (a collective: every rank builds its
PeerAllReduce at the same point) for the group's lifetime. A one-shot call is one kernel that copies the
input into this rank's buffer, waits for every rank's copy, and writes the sum into a new tensor (torch's
`one_shot_all_reduce_copy_out`; where torch lacks it, a copy kernel then the one-shot kernel). A two-shot
call copies the input in, reduces in the buffers and copies the sum back into the input. Every call
launches on the current stream, so it can be captured in a CUDA graph. Calls are serialised by the stream:
the kernels' own barriers keep one call's reads from racing the next call's copy.

Tensors larger than the buffer, or of a device/layout the kernels do not take, are left to NCCL
(`can_run` is False), as are groups whose GPUs cannot map each other's memory (the constructor raises
PeerMemoryUnavailable; the TPGroup then keeps NCCL for everything).
"""

from __future__ import annotations

import logging
import warnings

import torch

logger = logging.getLogger(__name__)

BUFFER_BYTES = 8 << 20
"""Size of each rank's peer buffer: the largest all-reduce this class takes (a 256-row decode step of a model
with hidden size 8192 in bf16 needs 4 MiB)."""
ONE_SHOT_MAX_BYTES = 256 << 10
"""All-reduces up to this size use the one-shot kernel, larger ones (up to BUFFER_BYTES) the two-shot one."""


class PeerMemoryUnavailable(RuntimeError):
    """The group's GPUs cannot share peer memory (no P2P access, or torch without symmetric memory)."""


class PeerAllReduce:
    def __init__(self, group: "torch.distributed.ProcessGroup", device: torch.device, dtype: torch.dtype):
        """Allocate this rank's buffer of `dtype` on `device` and exchange it with the group's other ranks
        (every rank calls this, in the same order as its other collectives)."""
        try:
            import torch.distributed._symmetric_memory as symm_mem  # noqa: PLC0415  (CUDA TP only)

            if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed by older torch, a no-op in newer
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)
                    symm_mem.enable_symm_mem_for_group(group.group_name)
            elems = BUFFER_BYTES // torch.empty((), dtype=dtype).element_size()
            self.buffer = symm_mem.empty(elems, dtype=dtype, device=device)
            symm_mem.rendezvous(self.buffer, group.group_name)
        except Exception as exc:  # noqa: BLE001 - any failure here means: no peer memory on this machine
            raise PeerMemoryUnavailable(f"peer-memory all-reduce unavailable on {device}: {exc}") from exc
        self.group_name = group.group_name
        self.dtype = dtype
        self.device = device
        self.copy_in_kernel = hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out")
        """One-shot calls copy their input inside the reducing kernel (one launch instead of two)."""

    def can_run(self, x: torch.Tensor) -> bool:
        """Whether `x` goes through peer memory: this rank's device and dtype, contiguous, fits the buffer."""
        return (
            x.device == self.device
            and x.dtype == self.dtype
            and x.is_contiguous()
            and x.numel() * x.element_size() <= BUFFER_BYTES
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` (which can_run accepts) over the ranks: a new tensor of x's shape (one-shot), or `x`
        itself with the sum written into it (two-shot). Every rank gets the same values."""
        flat = x.view(-1)
        staged = self.buffer[: flat.numel()]
        if flat.numel() * flat.element_size() > ONE_SHOT_MAX_BYTES:
            staged.copy_(flat)
            torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.group_name)
            flat.copy_(staged)
            return x
        out = torch.empty_like(flat)
        if self.copy_in_kernel:
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, flat, "sum", self.group_name, out)
        else:
            staged.copy_(flat)
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, out)
        return out.view_as(x)
