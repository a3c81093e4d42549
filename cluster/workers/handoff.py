"""The KV handoff from its sender (a prefill replica) to its receiver (a decode replica): what crosses between
them (docs/disaggregation.md, Vocabulary). The receiver's counters are workers/stats.HandoffCounters; the
transfer endpoint both sides own is workers/kv_endpoint.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the types stay light to import: the ingress imports them, torch is not needed there
    import numpy as np

    from cluster.kv_transfer import PeerInfo
    from cluster.kv_transfer.ranked import RankedPeerInfo
    from engine.scheduler.handoff import SenderHandoff


PREFILL_CALL_TIMEOUT_S = 600.0
"""Bound on one prefill call (queueing + compute + transfer)."""


class PrefillFailedError(RuntimeError):
    """The remote prefill of a request failed (the prefill replica died, refused, or the transfer failed
    or timed out). Raised by the decode replica before any token was produced, so the request may be
    retried. `prefill_dead`: the prefill replica is gone."""

    def __init__(self, message: str, prefill_id: str, prefill_dead: bool):
        super().__init__(message)
        self.prefill_id, self.prefill_dead = prefill_id, prefill_dead

    def __reduce__(self):
        return (PrefillFailedError, (str(self), self.prefill_id, self.prefill_dead))


@dataclass(frozen=True)
class TransferTarget:
    """Receiver → sender: where and how to write the prompt's KV."""

    replica_id: str
    """The prefill replica the receiver expects as the sender (refused by any other)."""
    peer: PeerInfo | RankedPeerInfo
    """The receiver's transfer endpoint (with tensor parallelism one PeerInfo per rank: each rank writes
    its own heads' pages into the same rank's pool there)."""
    prefix_len: int
    """Positions [0, prefix_len) are cached on the receiver; [prefix_len, prompt_len) are written."""
    dst_pages: np.ndarray
    """(pages,) int64 receiver's page ids of positions [prefix_len, prompt_len)."""
    transfer_id: str
    early_key: str = ""
    """The key under which the ingress started this prompt on the prefill replica ("" if it did not)."""


@dataclass(frozen=True)
class PrefillResult:
    """Sender → receiver: the engine's SenderHandoff and where the prefill call's time went."""

    handoff: SenderHandoff
    """The engine's handoff: first token, its logprobs, the prompt's pages on the sender."""
    compute_s: float
    """Queueing and computing the prompt in the prefill engine, from the call's arrival (a prompt the
    ingress started earlier counts only its part after that)."""
    transfer_s: float
    """Writing the KV into the receiver's pages, until the sender's handle is done."""
    entered_at: float
    left_at: float
    """Wall clock (time.time()) when the call started and ended on the prefill replica: with the
    receiver's own clock they split the call's transport time into out and back (exact on one host, to NTP
    accuracy across hosts)."""
