"""RadixCache: the prefix cache of one replica (SGLang's RadixAttention).

A radix tree over token ids. Every node below the root holds a run of tokens
(`key`, a list of ints) and the KV slot indices of those tokens (`value`,
(len(key),) int64, on the allocator's device); the path from the root to a
node spells a prefix whose KV is cached, and the slots along the path are that
prefix's KV, in order.

    root ── [1 2 3 4] ── [5 6 7 8] ── [9 10 11 12]
                      └─ [7 7 7 7]

Ownership: slots held by a node belong to the tree, which alone frees them,
through `allocator.free`, on `evict` and `reset`. Requests borrow a prefix by
locking the node their match ended at (`inc_lock_ref`), which locks the whole
path up to the root; locked nodes are never evicted.

Pages: with page_size > 1 every node's key length is a multiple of page_size,
children are keyed by their first page (a tuple of page_size tokens; with
page_size == 1 by their first token, an int), nodes split only at page
boundaries, and matches and inserts cover whole pages only.

Sizes: every token in the tree is counted once, as *evictable* (its node has
lock_ref == 0) or *protected* (lock_ref > 0). lock_ref never increases going
down a path, so an unlocked node's subtree is unlocked and evictable tokens
can always be reached by evicting leaves.

LRU: a logical clock ticks once per `match_prefix` / `insert` call; every node
those calls walk through gets the current tick. A parent's tick is therefore
never older than its children's, and `evict` takes unlocked leaves oldest first.

Events: each node created by `insert` and each node removed by `evict`
(or `reset`) is reported as a `CacheEvent` with the full token path, so the
router can replay them onto its approximate copy of the tree. Splits change no
content and emit nothing. Events accumulate until `drain_events` is called;
the owner must drain them regularly or pass enable_events=False.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Dict, Iterator, List, Literal, Optional, Sequence, Tuple, Union

import torch

from engine.outputs import CacheEvent

ChildKey = Union[int, Tuple[int, ...]]


class TreeNode:
    """One run of tokens and their KV slots. The root has an empty key and no value."""

    __slots__ = ("id", "key", "value", "parent", "children", "lock_ref", "last_access_time")

    def __init__(
        self,
        node_id: int,
        key: List[int],
        value: Optional[torch.Tensor],
        parent: Optional["TreeNode"],
        last_access_time: int,
    ):
        self.id = node_id
        self.key = key
        """Token ids of this run; len is a positive multiple of page_size (empty for the root)."""
        self.value = value
        """(len(key),) int64 slot indices; None for the root and for evicted nodes."""
        self.parent = parent
        self.children: Dict[ChildKey, TreeNode] = {}
        self.lock_ref = 0
        """Number of locks held on this node or any node below it."""
        self.last_access_time = last_access_time

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref}, t={self.last_access_time})"


@dataclass
class MatchResult:
    indices: torch.Tensor
    """(prefix_len,) int64, host: KV slots of the matched prefix, in order."""
    last_node: TreeNode
    """Deepest matched node (the root if nothing matched); lock it to protect the prefix."""
    prefix_len: int
    """Number of matched tokens; a multiple of page_size."""


@dataclass
class CacheStats:
    """Cumulative hit counters over `match_prefix` calls (not cleared by `reset`)."""

    queried_tokens: int = 0
    matched_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.matched_tokens / self.queried_tokens if self.queried_tokens else 0.0


class RadixCache:
    """Radix tree of cached prefixes; see the module docstring for the data structure.

    `allocator` needs `free(indices)`, indices a 1-D int64 tensor of token slots (whole
    pages when page_size > 1); its optional `device` attribute sets the device of empty
    match results (CPU otherwise).
    With disable=True nothing is ever cached: matches are empty, `insert` stores and frees
    nothing and returns 0 (the caller frees all its slots), `evict` frees nothing.
    """

    def __init__(self, allocator, page_size: int = 1, disable: bool = False, enable_events: bool = True):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.disable = disable
        self.enable_events = enable_events
        self.device = torch.device(getattr(allocator, "device", None) or "cpu")
        self.stats = CacheStats()
        self._events: List[CacheEvent] = []
        self._node_ids = itertools.count()
        self._clock = 0
        self.root = TreeNode(next(self._node_ids), [], None, None, self._clock)
        self._evictable_size = 0
        self._protected_size = 0
        self._empty = torch.empty((0,), dtype=torch.int64, device=self.device)

    # ---- lookup and insertion --------------------------------------------------
    def match_prefix(self, key: Sequence[int], *, record_stats: bool = True) -> MatchResult:
        """Longest cached prefix of `key`, in whole pages (a partial last page of `key` is ignored).

        Splits the node the match ends inside, so that `last_node` ends exactly at prefix_len;
        refreshes the LRU time of the matched path. Frees and takes no slots, and locks nothing:
        lock `last_node` before anything may evict (e.g. before allocating).
        record_stats=False leaves `stats` alone (for look-ups such as scheduling-policy probes).
        """
        key = self._as_list(key)
        if record_stats:
            self.stats.queried_tokens += len(key)
        if self.disable:
            return MatchResult(self._empty, self.root, 0)
        node, values, offset = self._walk(key[: len(key) - len(key) % self.page_size])
        if record_stats:
            self.stats.matched_tokens += offset
        indices = torch.cat(values) if values else self._empty
        return MatchResult(indices, node, offset)

    def insert(self, key: Sequence[int], value: torch.Tensor) -> int:
        """Cache `key` with KV slots `value` ((len(key),) int64); returns the length already cached.

        A partial last page of `key` is silently dropped (with its slots, which stay the
        caller's). Of the rest, [0, returned) was already in the tree: the tree keeps its own
        slots, and the caller frees value[its_locked_prefix_len:returned] (its duplicates).
        Slots value[returned:aligned_len] are copied into a new leaf and now belong to the tree.
        Disabled: stores nothing, returns 0.
        """
        key = self._as_list(key)
        if value.dim() != 1 or value.numel() != len(key):
            raise ValueError(f"value must be ({len(key)},) slot indices, got shape {tuple(value.shape)}")
        if self.disable:
            return 0
        aligned = len(key) - len(key) % self.page_size
        key = key[:aligned]
        node, _, offset = self._walk(key)
        if offset < aligned:
            self._add_leaf(node, key[offset:], value[offset:aligned].clone())
        return offset

    def _walk(self, key: List[int]) -> Tuple[TreeNode, List[torch.Tensor], int]:
        """Follow the page-aligned `key` down from the root as far as it is cached.

        Splits the node the match ends inside (so the returned node ends exactly at the
        returned offset) and stamps every node passed with a new LRU time. Returns the
        deepest node, the values along the path and the matched length.
        """
        self._clock += 1
        node, values, offset = self.root, [], 0
        while offset < len(key):
            child = node.children.get(self._child_key(key, offset))
            if child is None:
                break
            n = self._match_len(child.key, key, offset)
            if n < len(child.key):
                child = self._split_node(child, n)
            child.last_access_time = self._clock
            values.append(child.value)
            offset += n
            node = child  # after a split, no child of `node` matches key[offset:], so the loop ends
        return node, values, offset

    # ---- locking ---------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode) -> None:
        """Lock the path root → node; its tokens move from evictable to protected."""
        if node is not self.root and node.value is None:
            raise RuntimeError(f"{node!r} was evicted; lock a match before anything can evict")
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one `inc_lock_ref(node)`. Raises RuntimeError (changing nothing) if not locked."""
        walk = node
        while walk is not self.root:
            if walk.lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref on an unlocked path at {walk!r}")
            walk = walk.parent
        while node is not self.root:
            if node.lock_ref == 1:
                self._evictable_size += len(node.key)
                self._protected_size -= len(node.key)
            node.lock_ref -= 1
            node = node.parent

    # ---- eviction ---------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots if possible; returns the number freed.

        Removes unlocked leaves, least recently used first (a parent left childless joins
        the candidates), freeing their slots through the allocator; stops as soon as
        `num_tokens` are freed or nothing unlocked is left. Locked nodes are never touched.
        """
        if self.disable or num_tokens <= 0:
            return 0
        heap = [(n.last_access_time, n.id, n) for n in self._iter_nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            freed += self._remove_leaf(node)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        return freed

    def reset(self) -> None:
        """Free every node's slots and empty the tree (emitting an evict event per node).

        Only valid while no node below the root is locked (raises RuntimeError otherwise):
        lock holders would keep using freed slots. The root stays (holders of empty matches
        may still unlock it). Stats are cumulative and survive.
        """
        if self._protected_size:
            raise RuntimeError(f"reset with {self._protected_size} locked tokens in the tree")
        self.evict(self._evictable_size)
        assert not self.root.children and self._evictable_size == 0, "unlocked tree not emptied by evict"

    # ---- sizes and events --------------------------------------------------------
    def evictable_size(self) -> int:
        """Tokens in unlocked nodes (freeable by `evict`)."""
        return self._evictable_size

    def protected_size(self) -> int:
        """Tokens in locked nodes."""
        return self._protected_size

    def total_size(self) -> int:
        """All tokens in the tree, counted by walking it (O(nodes))."""
        return sum(len(n.key) for n in self._iter_nodes())

    def drain_events(self) -> List[CacheEvent]:
        """Events since the last drain, oldest first; clears the buffer."""
        events, self._events = self._events, []
        return events

    # ---- internals ---------------------------------------------------------------
    @staticmethod
    def _as_list(key: Sequence[int]) -> List[int]:
        return key.tolist() if isinstance(key, torch.Tensor) else list(key)

    def _child_key(self, key: Sequence[int], offset: int) -> ChildKey:
        if self.page_size == 1:
            return key[offset]
        return tuple(key[offset : offset + self.page_size])

    def _match_len(self, node_key: List[int], key: List[int], offset: int) -> int:
        """Tokens of node_key equal to key[offset:], rounded down to whole pages."""
        n = min(len(node_key), len(key) - offset)
        if node_key[:n] == key[offset : offset + n]:
            return n - n % self.page_size
        ps, i = self.page_size, 0
        while i + ps <= n and node_key[i : i + ps] == key[offset + i : offset + i + ps]:
            i += ps
        return i

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        """Cut `child` after split_len tokens (a page multiple); returns the new upper node.

        The upper node inherits child's lock_ref and access time, so sizes and locks
        (including locks held on `child` itself) stay valid.
        """
        parent = child.parent
        top = TreeNode(
            next(self._node_ids), child.key[:split_len], child.value[:split_len], parent, child.last_access_time
        )
        top.lock_ref = child.lock_ref
        parent.children[self._child_key(top.key, 0)] = top
        child.key = child.key[split_len:]
        child.value = child.value[split_len:]
        child.parent = top
        top.children[self._child_key(child.key, 0)] = child
        return top

    def _add_leaf(self, parent: TreeNode, key: List[int], value: torch.Tensor) -> TreeNode:
        leaf = TreeNode(next(self._node_ids), key, value, parent, self._clock)
        parent.children[self._child_key(key, 0)] = leaf
        self._evictable_size += len(key)
        self._record("insert", leaf)
        return leaf

    def _remove_leaf(self, node: TreeNode) -> int:
        """Free an unlocked leaf's slots and detach it; returns its token count."""
        self._record("evict", node)
        self.allocator.free(node.value)
        del node.parent.children[self._child_key(node.key, 0)]
        node.value = None
        self._evictable_size -= len(node.key)
        return len(node.key)

    def _record(self, kind: Literal["insert", "evict"], node: TreeNode) -> None:
        if not self.enable_events:
            return
        runs, walk = [], node
        while walk is not self.root:
            runs.append(walk.key)
            walk = walk.parent
        path = tuple(t for run in reversed(runs) for t in run)
        self._events.append(CacheEvent(kind, path, len(node.key)))

    def _iter_nodes(self) -> Iterator[TreeNode]:
        """Every node except the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
