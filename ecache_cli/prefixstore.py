"""PrefixStore: prompts' keys and values kept across requests, keyed by token-id prefix.

The store only stores (a leaf, like ``kvstore.py``): who may reuse what, and whether reuse is exact, is
decided by the server and the cache policy (docs/SERVING.md, "Prefix reuse"). A prompt is cut into
chunks of ``chunk`` tokens from its first token; the entry of chunk j holds the keys (after RoPE) and
values of every layer at those positions, computed with the chunks before it, and is found by its
tokens and its parent entry (chunk j - 1's), so a lookup walks a chain of exact token matches (a
radix tree of fixed-size edges; no hash can collide). RoPE: position = index in the prompt
(``KVStore.positions``), so a chunk's keys fit every prompt that starts with the same tokens, whatever
its left padding.

Memory is bounded by ``max_bytes``: adding past it evicts the least recently used entries (a lookup
or an add makes an entry the most recent), each with the entries below it, which no lookup can reach
without it. Entries live on the device their tensors came from (the engine's).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class _Entry:
    """One chunk: ``kv`` (2, L, H_kv, chunk, D), its key in the store and the entries below it."""

    key: tuple
    kv: torch.Tensor
    uid: int
    children: set = field(default_factory=set)


@dataclass
class PrefixStats:
    """Counts since the store was made: ``lookups`` (prompts looked up), ``hits`` (of them, ones that
    found at least one chunk), ``prompt_tokens`` (tokens of the prompts looked up), ``reused_tokens``
    (of them, tokens found), ``added`` (chunks stored), ``evictions`` (chunks evicted)."""

    lookups: int = 0
    hits: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    added: int = 0
    evictions: int = 0


class PrefixStore:
    """Keys and values of prompt chunks, least recently used first out (module docstring).

    ``chunk``: tokens per entry (≥ 1). ``max_bytes``: the most bytes the entries' tensors take together
    (≥ 0; 0 stores nothing). ``root``: what the keys and values depend on beyond the tokens (e.g. a
    block-causal model's block length), so prefixes computed under other settings never match.
    Raises ValueError on a ``chunk`` < 1 or ``max_bytes`` < 0.
    """

    def __init__(self, chunk: int, max_bytes: int):
        if chunk < 1 or max_bytes < 0:
            raise ValueError(f"PrefixStore needs chunk >= 1 and max_bytes >= 0, got {chunk} and {max_bytes}")
        self.chunk, self.max_bytes = chunk, max_bytes
        self.bytes = 0
        self.stats = PrefixStats()
        self._entries: collections.OrderedDict[tuple, _Entry] = collections.OrderedDict()  # oldest use first
        self._uid = 0
        self._ids: dict[int, _Entry] = {}  # uid → entry

    def __len__(self) -> int:
        return len(self._entries)

    def _chain(self, ids, root) -> list[_Entry]:
        """The stored entries of ``ids``' leading whole chunks, in order, up to the first one missing."""
        found, parent = [], ("root", root)
        for j in range(len(ids) // self.chunk):
            e = self._entries.get((parent, tuple(ids[j * self.chunk:(j + 1) * self.chunk])))
            if e is None:
                break
            found.append(e)
            parent = e.uid
        return found

    def lookup(self, ids, root=None, limit: int | None = None, unit: int = 1) -> torch.Tensor | None:
        """(2, L, H_kv, n, D) the keys and values of ``ids``' longest stored prefix of whole chunks, cut
        to a multiple of ``unit`` tokens (n, at most ``limit``), or None when that leaves none; counted
        in ``stats``, and the entries used become the most recently used."""
        chain = self._chain(ids if limit is None else ids[:limit], root)
        n = len(chain) * self.chunk // unit * unit
        chain = chain[:-(-n // self.chunk)] if n else []
        self.stats.lookups += 1
        self.stats.prompt_tokens += len(ids)
        if not chain:
            return None
        for e in chain:
            self._entries.move_to_end(e.key)
        self.stats.hits += 1
        self.stats.reused_tokens += n
        return torch.cat([e.kv for e in chain], dim=3)[:, :, :, :n]

    def stored(self, ids, root=None) -> int:
        """Tokens of ``ids``' leading whole chunks already stored (no counting, no reordering)."""
        return len(self._chain(ids, root)) * self.chunk

    def add(self, ids, kv, root=None) -> int:
        """Store the whole chunks of ``ids`` (a prompt's leading tokens) with ``kv`` (2, L, H_kv, n, D),
        their keys and values (n ≥ the whole chunks' tokens; a callable ``kv(start, end)`` giving those
        of positions [start, end) is read only for the chunks not stored yet). Evicts least recently
        used entries past ``max_bytes``; a chunk larger than ``max_bytes`` alone is not stored. Returns
        the chunks added."""
        parent, added, chain = ("root", root), 0, set()
        for j in range(len(ids) // self.chunk):
            lo, hi = j * self.chunk, (j + 1) * self.chunk
            key = (parent, tuple(ids[lo:hi]))
            e = self._entries.get(key)
            if e is None:
                part = kv(lo, hi) if callable(kv) else kv[:, :, :, lo:hi]
                size = part.numel() * part.element_size()
                if size > self.max_bytes:
                    break
                if not self._evict(self.max_bytes - size, keep=chain):  # only this prompt's chunks are left
                    break
                e = _Entry(key, part.clone(), self._uid)
                self._uid += 1
                self._entries[key] = self._ids[e.uid] = e
                self.bytes += size
                self.stats.added += 1
                added += 1
                if parent != ("root", root):
                    self._ids[parent].children.add(key)
            else:
                self._entries.move_to_end(key)
            parent = e.uid
            chain.add(e.uid)
        return added

    def _evict(self, room: int, keep: set) -> bool:
        """Evict least recently used entries (each with every entry below it) until at most ``room``
        bytes are held, never one of ``keep`` (uids: the chunks of the prompt being added) or an entry
        above one of them. Returns False when only those are left above ``room``."""
        while self.bytes > room:
            victim = next((e for e in self._entries.values() if e.uid not in keep), None)
            if victim is None:
                return False
            self._drop(victim)
        return True

    def _drop(self, e: _Entry) -> None:
        """Remove ``e`` and the entries below it."""
        for child in list(e.children):
            if child in self._entries:
                self._drop(self._entries[child])
        del self._entries[e.key]
        del self._ids[e.uid]
        owner = self._ids.get(e.key[0]) if isinstance(e.key[0], int) else None
        if owner is not None:
            owner.children.discard(e.key)
        self.bytes -= e.kv.numel() * e.kv.element_size()
        self.stats.evictions += 1
