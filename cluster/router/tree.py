"""ApproximateTree: the router's copy of one worker's prefix cache.

A token-level radix tree. Every node below the root holds a run of token ids
(`key`, a tuple); the path from the root to a node spells a prefix that the
router believes the worker has cached. Children are keyed by the first token
of their run, so a lookup costs one dict probe per node plus one C-level tuple
comparison per run.

    root ── (1 2 3 4) ── (5 6 7 8) ── (9 10)
                      └─ (7 7 7 7)

"Approximate": the tree learns from two sources and trusts both —
  * routing: `insert(prompt)` when a request is sent to the worker (it will be
    cached there soon), as SGLang's router does;
  * the worker's `CacheEvent`s (`apply_event`): inserts add their full path,
    evictions cut the evicted run and everything below it. Events about paths
    the tree never saw, or has already forgotten, are no-ops, so duplicated,
    late or reordered events never raise and never corrupt the tree.

LRU and size cap: a logical clock ticks once per `insert`; every node an
insert walks through gets the tick (`match` is read-only and touches nothing,
because the router matches every worker's tree for every request but routes to
one). When the tree holds more than `max_tokens` tokens, whole leaves are
removed oldest first until it fits again. A parent's tick is never older than
its children's, so evicting leaves removes the least recently routed suffixes.
Leaves are found through a heap with lazy invalidation: an entry
(tick, seq, node) is valid while the node is alive, childless and still has
that tick; every leaf always has one valid entry.

Not thread-safe: one event loop (the router replica) owns a tree.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Iterator, List, Optional, Sequence, Tuple

Tokens = Tuple[int, ...]


class _Node:
    __slots__ = ("key", "children", "parent", "last_access", "alive")

    def __init__(self, key: Tokens, parent: Optional["_Node"], last_access: int):
        self.key = key
        self.children: dict = {}
        self.parent = parent
        self.last_access = last_access
        self.alive = True


def _as_tokens(token_ids: Sequence[int]) -> Tokens:
    return token_ids if isinstance(token_ids, tuple) else tuple(token_ids)


def _common_prefix_len(key: Tokens, tokens: Tokens, pos: int) -> int:
    """Length of the common prefix of `key` and `tokens[pos:]`; key[0] == tokens[pos] is known."""
    limit = min(len(key), len(tokens) - pos)
    i = 1
    for step in (64, 16, 4, 1):  # C-level slice compares, coarse to fine
        while i + step <= limit and key[i : i + step] == tokens[pos + i : pos + i + step]:
            i += step
    return i


class ApproximateTree:
    """Radix tree of the prefixes one worker is believed to cache.

    max_tokens: size cap in tokens (None: unbounded); an `insert` that pushes the
    tree over the cap evicts least recently inserted leaves, possibly including
    parts of the new path itself when one prompt is longer than the cap.
    page_size: the worker's KV page size; an eviction event then removes only
    what shares the evicted run's first page (see `remove_prefix`).
    """

    def __init__(self, max_tokens: Optional[int] = None, page_size: int = 1):
        if max_tokens is not None and max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.max_tokens = max_tokens
        self.page_size = page_size
        self._seq = itertools.count()
        self.clear()

    def clear(self) -> None:
        self._root = _Node((), None, 0)
        self._clock = 0
        self._size = 0
        self._num_nodes = 0
        self._leaf_heap: List[Tuple[int, int, _Node]] = []

    # --- queries -------------------------------------------------------------------------------

    def size(self) -> int:
        """Tokens held (each token of each node counted once)."""
        return self._size

    def num_nodes(self) -> int:
        return self._num_nodes

    def match(self, token_ids: Sequence[int]) -> int:
        """Length of the longest cached prefix of `token_ids`. Read-only (no LRU update)."""
        tokens = _as_tokens(token_ids)
        node, pos, n = self._root, 0, len(tokens)
        while pos < n:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            key = child.key
            if tokens[pos : pos + len(key)] == key:
                pos += len(key)
                node = child
                continue
            return pos + _common_prefix_len(key, tokens, pos)
        return pos

    def paths(self) -> Iterator[Tokens]:
        """Every root-to-leaf path (for tests and debugging)."""
        stack = [(child, child.key) for child in self._root.children.values()]
        while stack:
            node, path = stack.pop()
            if not node.children:
                yield path
            stack.extend((c, path + c.key) for c in node.children.values())

    # --- updates -------------------------------------------------------------------------------

    def insert(self, token_ids: Sequence[int]) -> int:
        """Add `token_ids` as a cached path and mark it most recently used.

        Returns the length of the prefix that was already present (before any
        eviction the insert causes).
        """
        tokens = _as_tokens(token_ids)
        self._clock += 1
        now = self._clock
        node, pos, n = self._root, 0, len(tokens)
        while pos < n:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            key = child.key
            if tokens[pos : pos + len(key)] == key:
                step = len(key)
            else:
                step = _common_prefix_len(key, tokens, pos)
                child = self._split(child, step)
            child.last_access = now
            node = child
            pos += step
        matched = pos
        if pos < n:
            leaf = _Node(tokens[pos:], node, now)
            node.children[tokens[pos]] = leaf
            self._size += n - pos
            self._num_nodes += 1
            self._push_leaf(leaf)
        elif node is not self._root and not node.children:
            self._push_leaf(node)  # an existing leaf got a newer tick
        if self.max_tokens is not None and self._size > self.max_tokens:
            self._evict_lru()
        return matched

    def remove_prefix(self, token_ids: Sequence[int], num_tokens: int) -> int:
        """Forget the last `num_tokens` tokens of the path `token_ids` and everything below them.

        Mirrors an eviction on the worker: the evicted run E = token_ids[cut:] (cut =
        len - num_tokens) was a leaf, and the worker's children are keyed by their
        first page, so nothing extending token_ids[:cut] + E[:page] is cached there.
        The tree removes exactly those paths, then trims the run back towards depth
        `cut` while no other path shares it. Paths the tree does not hold are left
        alone; returns the number of tokens removed.
        """
        tokens = _as_tokens(token_ids)
        num_tokens = min(num_tokens, len(tokens))
        if num_tokens <= 0:
            return 0
        cut = len(tokens) - num_tokens
        end = cut + min(self.page_size, num_tokens)
        # Walk down to depth `end`; node covers depths [start, start + len(node.key)).
        node, start, pos = self._root, 0, 0
        while pos < end:
            child = node.children.get(tokens[pos])
            if child is None:
                return 0
            span = min(len(child.key), end - pos)
            if child.key[:span] != tokens[pos : pos + span]:
                return 0
            node, start, pos = child, pos, pos + span
        before = self._size
        for child in list(node.children.values()):
            self._drop_subtree(child)
        node.children.clear()
        self._truncate(node, end - start)
        # Trim back to `cut` while the run is a leaf that no other path shares.
        while node is not self._root and not node.children and start + len(node.key) > cut:
            if cut > start:
                self._truncate(node, cut - start)
                self._push_leaf(node)
                break
            parent = node.parent
            self._detach(node)
            node = parent
            start -= len(node.key)
        else:
            if node is not self._root and not node.children:
                self._push_leaf(node)
        return before - self._size

    def apply_event(self, event) -> int:
        """Replay one worker `CacheEvent` (kind, token_ids, num_tokens); duck-typed.

        insert: the whole path is cached on the worker, so it is inserted whole.
        evict: `remove_prefix(token_ids, num_tokens)`.
        Returns the change in size (tokens).
        """
        before = self._size
        if event.kind == "insert":
            self.insert(event.token_ids)
        elif event.kind == "evict":
            self.remove_prefix(event.token_ids, event.num_tokens)
        else:
            raise ValueError(f"unknown cache event kind {event.kind!r}")
        return self._size - before

    # --- internals -----------------------------------------------------------------------------

    def _split(self, child: _Node, n: int) -> _Node:
        """Split `child` after its first n tokens; returns the new top node.

        The bottom keeps the original object, so its heap entry stays valid.
        """
        parent = child.parent
        top = _Node(child.key[:n], parent, child.last_access)
        parent.children[child.key[0]] = top
        child.key = child.key[n:]
        child.parent = top
        top.children[child.key[0]] = child
        self._num_nodes += 1
        return top

    def _truncate(self, node: _Node, length: int) -> None:
        self._size -= len(node.key) - length
        node.key = node.key[:length]

    def _detach(self, node: _Node) -> None:
        """Remove a childless node from its parent."""
        del node.parent.children[node.key[0]]
        node.alive = False
        self._size -= len(node.key)
        self._num_nodes -= 1

    def _drop_subtree(self, node: _Node) -> None:
        stack = [node]
        while stack:
            cur = stack.pop()
            stack.extend(cur.children.values())
            cur.alive = False
            self._size -= len(cur.key)
            self._num_nodes -= 1

    def _push_leaf(self, node: _Node) -> None:
        heapq.heappush(self._leaf_heap, (node.last_access, next(self._seq), node))
        if len(self._leaf_heap) > 2 * self._num_nodes + 1024:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        heap, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                heap.append((node.last_access, next(self._seq), node))
        heapq.heapify(heap)
        self._leaf_heap = heap

    def _evict_lru(self) -> None:
        while self._size > self.max_tokens and self._leaf_heap:
            tick, _, node = heapq.heappop(self._leaf_heap)  # _push_leaf may rebuild the heap
            if not node.alive or node.children or node.last_access != tick:
                continue  # stale entry
            parent = node.parent
            self._detach(node)
            if parent is not self._root and not parent.children:
                self._push_leaf(parent)
