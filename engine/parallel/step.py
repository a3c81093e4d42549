"""One step of rank 0, sent to the other tensor-parallel ranks as tensors (never pickled objects).

Rank 0's scheduler decides; every rank runs the same forward on its shard. Per step rank 0 broadcasts

    control group (host int64)   header  [op, mode, batch size, packed length, table edits E,
                                          logit segments S, sampled rows]
                                 payload [ForwardBatch.packed | edit rows, cols, slots (3 E) |
                                          segment starts and lengths (2 S)]
    compute group (device int64) the step's input ids (T): overlap scheduling may have put tokens sampled
                                 by the batch still in flight there, on the device, after the plan

The table edits are rank 0's ReqToTokenPool writes since the last step (RecordingReqToTokenPool), which
every rank replays into its copy of the table: KV slot indices mean the same on every rank, since every
rank's KV pool has the same slots (fewer heads). The logit rows tell the other ranks which compute_logits
calls rank 0 makes after the forward, in order — the prompt-logprob segments, then the sampled rows — so
that they join the same vocabulary all-gathers. Only rank 0 samples: the other ranks never need the tokens,
which come back to them as the next step's input ids.

Between two steps rank 0 may also send a call (`send_call`): `module.function(runner, *args)` run by every
other rank in its step loop, in order with the steps (the cluster's per-rank KV transfer endpoints are
driven so). Its arguments are pickled: calls are control messages, rare next to steps.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any, List, Tuple, Union

import torch

from engine.forward_batch import ForwardBatch, ForwardMode
from engine.parallel.group import TPGroup

OP_STEP, OP_STOP, OP_CALL = 1, 2, 3
_HEADER = 7
_MODES = (ForwardMode.EXTEND, ForwardMode.DECODE)


@dataclass
class StepInputs:
    """What a follower rank needs to run one of rank 0's steps."""

    forward_batch: ForwardBatch
    """The batch on this rank's device (input ids from rank 0's device tensor)."""
    table_edits: torch.Tensor
    """(3, E) int64, host — ReqToTokenPool cells (row, column, slot) to write before the forward."""
    logit_segments: List[Tuple[int, int]]
    """(first row, rows) of the hidden states whose logits rank 0 computes for prompt logprobs, in order."""
    num_sampled: int
    """Rank 0 then computes the logits of fb.last_token_rows[:num_sampled] (0: none)."""


@dataclass(frozen=True)
class RankCall:
    """A call rank 0 asks every other rank to make between two steps: `module.function(runner, *args)`."""

    module: str
    function: str
    args: Tuple[Any, ...]


def send_step(
    group: TPGroup,
    fb: ForwardBatch,
    table_edits: torch.Tensor,
    logit_segments: List[Tuple[int, int]],
    num_sampled: int,
) -> None:
    """Rank 0: announce the step about to run `fb` (see the module docstring)."""
    if fb.packed is None:
        raise RuntimeError("a tensor-parallel step needs the batch's host layout (out_cache_loc on the host)")
    segments = torch.tensor(logit_segments, dtype=torch.int64).reshape(-1)
    header = torch.tensor(
        [
            OP_STEP,
            _MODES.index(fb.forward_mode),
            fb.batch_size,
            fb.packed.numel(),
            table_edits.shape[1],
            len(logit_segments),
            num_sampled,
        ],
        dtype=torch.int64,
    )
    group.broadcast_control(header)
    group.broadcast_control(torch.cat([fb.packed, table_edits.reshape(-1), segments]))
    group.broadcast_compute(fb.input_ids)


def send_stop(group: TPGroup) -> None:
    """Rank 0: tell the other ranks to leave their step loop."""
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0] = OP_STOP
    group.broadcast_control(header)


def send_call(group: TPGroup, call: RankCall) -> None:
    """Rank 0: have every other rank make `call` after the steps sent before it."""
    data = pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL)
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[3] = OP_CALL, len(data)
    payload = torch.zeros((len(data) + 7) // 8, dtype=torch.int64)
    payload.view(torch.uint8)[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    group.broadcast_control(header)
    group.broadcast_control(payload)


def receive_step(group: TPGroup) -> Union[StepInputs, RankCall, None]:
    """A follower rank: wait for rank 0's next step (or call); None when rank 0 stops the group."""
    header = torch.empty(_HEADER, dtype=torch.int64)
    group.broadcast_control(header)
    op, mode, bs, packed_len, num_edits, num_segments, num_sampled = header.tolist()
    if op == OP_STOP:
        return None
    if op == OP_CALL:
        payload = torch.empty((packed_len + 7) // 8, dtype=torch.int64)
        group.broadcast_control(payload)
        return pickle.loads(payload.view(torch.uint8)[:packed_len].numpy().tobytes())
    if op != OP_STEP:
        raise RuntimeError(f"unknown tensor-parallel step op {op}")
    payload = torch.empty(packed_len + 3 * num_edits + 2 * num_segments, dtype=torch.int64)
    group.broadcast_control(payload)
    packed, edits, segments = payload.split([packed_len, 3 * num_edits, 2 * num_segments])
    num_tokens = (packed_len - 5 * bs) // 3
    input_ids = torch.empty(num_tokens, dtype=torch.int64, device=group.device)
    group.broadcast_compute(input_ids)
    fb = ForwardBatch.from_packed(_MODES[mode], packed, bs, group.device, input_ids=input_ids)
    pairs = segments.reshape(-1, 2).tolist()
    return StepInputs(fb, edits.reshape(3, -1), [(s, n) for s, n in pairs], num_sampled)
