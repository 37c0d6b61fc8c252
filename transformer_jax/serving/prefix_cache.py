"""Prefix reuse: full pages keyed by the tokens they hold and every token before them.

A full page is named by a digest chained over the sequence's pages,
``digest_j = blake2b(digest_{j-1} || tokens of page j)``, so two sequences share the name of
page j exactly when their first ``(j + 1) * page_size`` tokens agree. A new request whose prompt
starts with named pages shares them and prefills only the rest. A named page nobody holds is
parked, not freed, until the pool runs short (least recently used evicted first). A shared page
is never written again.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

import numpy as np

from transformer_jax.serving.page_pool import PagePool


def page_digests(tokens: Sequence[int], page_size: int, known: list[bytes] | None = None,
                 root: bytes = b"") -> list[bytes]:
    """The chained digests of every full page of ``tokens``.

    Args:
      tokens: the sequence's token ids.
      page_size: positions per page.
      known: digests already computed for the first pages (extended, not recomputed).
      root: what the chain starts from (a LoRA adapter's name; empty for the base model).

    Returns:
      One 16-byte digest per full page, ``len(tokens) // page_size`` of them.
    """
    digests = list(known or [])
    arr = np.asarray(tokens, np.int64)
    for j in range(len(digests), len(arr) // page_size):
        h = hashlib.blake2b(digests[-1] if digests else root, digest_size=16)
        h.update(arr[j * page_size:(j + 1) * page_size].tobytes())
        digests.append(h.digest())
    return digests


class PrefixCache:
    """Named full pages over a ``PagePool``, with LRU eviction of the pages nobody holds
    (``enabled=False``: nothing is named or found)."""

    def __init__(self, pool: PagePool, enabled: bool = True) -> None:
        self.pool = pool
        self.enabled = enabled
        self._page_of: dict[bytes, int] = {}
        self._name_of: dict[int, bytes] = {}
        # Parked pages (count 0, named), least recently used first.
        self._parked: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.hits = 0  # pages found by ``match`` since creation
        self.queries = 0  # pages asked for by ``match``

    @property
    def num_available(self) -> int:
        """Pages an ``allocate`` can hand out: free plus parked (evictable)."""
        return self.pool.num_free + len(self._parked)

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def match(self, digests: Sequence[bytes]) -> list[int]:
        """The pages named by the longest run of leading ``digests`` found, each now held once
        more by the caller."""
        pages: list[int] = []
        if not self.enabled:
            return pages
        self.queries += len(digests)
        for digest in digests:
            page = self._page_of.get(digest)
            if page is None:
                break
            self._parked.pop(page, None)
            self.pool.share(page)  # a parked page (count 0) is held again
            pages.append(page)
        self.hits += len(pages)
        return pages

    def insert(self, digest: bytes, page: int) -> None:
        """Names a held, full ``page`` (no-op when another page already has that name)."""
        if not self.enabled or digest in self._page_of or page in self._name_of:
            return
        self._page_of[digest] = page
        self._name_of[page] = digest

    def release(self, pages: Sequence[int]) -> None:
        """The caller holds ``pages`` no longer: each one nobody holds is parked if named
        (most recently used), else freed."""
        for page in pages:
            if self.pool.release(page):
                if page in self._name_of:
                    self._parked[page] = None
                else:
                    self.pool.free(page)

    def allocate(self, n: int) -> list[int] | None:
        """n pages, evicting the least recently used parked pages when the free list is short;
        None (and nothing evicted) when even that is not enough."""
        if n > self.num_available:
            return None
        while self.pool.num_free < n:
            page, _ = self._parked.popitem(last=False)
            del self._page_of[self._name_of.pop(page)]
            self.pool.free(page)
        return self.pool.allocate(n)

    def clear(self) -> None:
        """Evicts every parked page (held named pages keep their names until released)."""
        while self._parked:
            page, _ = self._parked.popitem(last=False)
            del self._page_of[self._name_of.pop(page)]
            self.pool.free(page)
