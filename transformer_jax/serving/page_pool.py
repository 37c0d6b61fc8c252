"""The host-side bookkeeping of the paged KV cache's pages: the allocator and the null page.

``PagedKVCache`` (``paged_cache.py``) holds the pages' contents on the device; which pages a
sequence holds is decided here, in plain Python and numpy, by the engine's scheduler.
"""

from __future__ import annotations

import collections

import numpy as np

#: The page no sequence owns: never handed out, it takes the writes that belong to no page, and
#: page-table entries of pages a row does not hold point at it.
NULL_PAGE = 0


def pages_for(length: int, page_size: int) -> int:
    """Pages that hold ``length`` positions: ``ceil(length / page_size)``."""
    return -(-length // page_size)


class PagePool:
    """The host-side allocator of a cache's pages: a free list and reference counts.

    Pages 1..P-1 are handed out (page 0 is ``NULL_PAGE``). A page is free (count 0, on the
    free list), held (count > 0) or parked (count 0, kept by a ``PrefixCache`` until evicted).
    """

    def __init__(self, num_pages: int) -> None:
        if not isinstance(num_pages, int) or num_pages < 2:
            raise ValueError(f"num_pages must be an int >= 2 (page 0 is the null page), got "
                             f"{num_pages!r}")
        self.num_pages = num_pages
        self._refs = np.zeros(num_pages, np.int64)
        self._free: collections.deque[int] = collections.deque(range(1, num_pages))
        self._is_free = np.ones(num_pages, bool)
        self._is_free[NULL_PAGE] = False

    @property
    def capacity(self) -> int:
        """Pages that can ever be handed out: P - 1."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n free pages, each with count 1; None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        pages = [self._free.popleft() for _ in range(n)]
        self._refs[pages] = 1
        self._is_free[pages] = False
        return pages

    def share(self, page: int) -> None:
        """One more holder of a held or parked page."""
        if self._is_free[page] or page == NULL_PAGE:
            raise ValueError(f"page {page} is free or the null page; it cannot be shared")
        self._refs[page] += 1

    def release(self, page: int) -> bool:
        """One holder fewer; True when that was the last (the caller then frees or parks it)."""
        if self._refs[page] <= 0:
            raise ValueError(f"page {page} is not held (reference count {self._refs[page]})")
        self._refs[page] -= 1
        return self._refs[page] == 0

    def free(self, page: int) -> None:
        """Returns a page nobody holds to the free list."""
        if self._refs[page] != 0 or self._is_free[page] or page == NULL_PAGE:
            raise ValueError(f"page {page} cannot be freed (count {self._refs[page]}, "
                             f"free {bool(self._is_free[page])})")
        self._is_free[page] = True
        self._free.append(page)

    def held(self) -> dict[int, int]:
        """{page: reference count} of every held page (empty when nothing leaked)."""
        return {int(p): int(self._refs[p]) for p in np.flatnonzero(self._refs)}
