"""Which KV-cache pages each sequence holds: the paged cache's bookkeeping, plain data only.

Two pools (global, sliding-window), page 0 of each a scratch page. Global layers keep every page;
local layers keep only the pages their window can still see (vLLM's hybrid allocator). Prefix
caching names a full page by its parent's hash and its tokens; pages are shared by reference, cached
least recently used first out. See docs/engine.md, "The paged engine"."""
from __future__ import annotations

import collections
import dataclasses
import hashlib

import numpy as np

SCRATCH = 0  # page 0 of each pool: padding tokens write there, unused table entries point there


def block_hashes(tokens, page_size: int, images=()) -> list[bytes]:
    """The hash of every full `page_size`-token page of `tokens`, each over its parent's hash and
    its own token ids (so a hash names the whole prefix up to its page's end). `images`:
    (spans, content hash) of the prompt's images: a page holding any of an image's soft tokens
    hashes that image's content too, since the soft tokens' ids are the same for every image
    (vLLM's multimodal hashes)."""
    out, parent = [], b""
    tokens = np.asarray(tokens, "<i4")
    for i in range(len(tokens) // page_size):
        h = hashlib.blake2b(parent, digest_size=16)
        lo, hi = i * page_size, (i + 1) * page_size
        for spans, key in images:
            if any(a < hi and lo < b for a, b in spans):
                h.update(str(key).encode())
        h.update(tokens[i * page_size:(i + 1) * page_size].tobytes())
        parent = h.digest()
        out.append(parent)
    return out


class PagePool:
    """The pages of one pool: free pages, refcounts, and the cached (hash-named) pages no one
    holds, least recently used first. Page 0 is never handed out."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"a page pool needs at least 2 pages (one is scratch), got {num_pages}")
        self.num_pages = num_pages
        self.refs = [0] * num_pages
        self._fresh = collections.deque(range(1, num_pages))  # free and named by no hash
        self._idle: collections.OrderedDict[int, bytes] = collections.OrderedDict()  # ref 0, cached
        self._page_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}

    @property
    def num_free(self) -> int:
        """Pages that can be taken now (cached pages no one holds count: they are evicted)."""
        return len(self._fresh) + len(self._idle)

    @property
    def num_cached(self) -> int:
        return len(self._page_of)

    def take(self) -> int:
        """A page for new contents (refcount 1): a fresh one, else the least recently used
        cached page, which forgets its hash."""
        if self._fresh:
            page = self._fresh.popleft()
        elif self._idle:
            page, h = self._idle.popitem(last=False)
            del self._page_of[h], self._hash_of[page]
        else:
            raise MemoryError("no free KV-cache page")
        self.refs[page] = 1
        return page

    def lookup(self, h: bytes) -> int | None:
        return self._page_of.get(h)

    def hold(self, page: int) -> None:
        """One more holder of a cached page (a prefix hit)."""
        if self.refs[page] == 0:
            self._idle.pop(page, None)
        self.refs[page] += 1

    def release(self, page: int) -> None:
        if self.refs[page] <= 0:
            raise ValueError(f"page {page} released more often than held")
        self.refs[page] -= 1
        if self.refs[page] == 0:
            h = self._hash_of.get(page)
            if h is None:
                self._fresh.append(page)
            else:
                self._idle[page] = h  # most recently used end

    def name(self, page: int, h: bytes) -> None:
        """Registers a full page's contents under its prefix hash (first page named wins: a
        second page with the same contents stays unnamed and is freed as usual)."""
        if h in self._page_of or page in self._hash_of:
            return
        self._page_of[h] = page
        self._hash_of[page] = h

    def clear_names(self) -> None:
        """Forgets every hash (the device pages may be lost, after an engine failure)."""
        for page in list(self._idle):
            self._fresh.append(page)
        self._idle.clear()
        self._page_of.clear()
        self._hash_of.clear()


@dataclasses.dataclass
class SeqPages:
    """One sequence's block tables. global_pages[j] holds logical page j; local_pages[i] holds
    logical page local_first + i."""

    global_pages: list[int] = dataclasses.field(default_factory=list)
    local_first: int = 0
    local_pages: list[int] = dataclasses.field(default_factory=list)
    named: int = 0  # leading full pages already registered under their prefix hash


class KVPages:
    """The two pools and every sequence's block tables (see the module docstring).

    window: the local layers' sliding window W (None: the model has no local layers, and the
    local pool is not used); has_global: whether it has global layers."""

    def __init__(self, page_size: int, num_global_pages: int, num_local_pages: int,
                 window: int | None, has_global: bool = True):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.window = window
        self.global_pool = PagePool(num_global_pages) if has_global else None
        self.local_pool = PagePool(num_local_pages) if window is not None else None
        self.seqs: dict[int, SeqPages] = {}
        self.queries = self.hits = 0  # prompt tokens looked up / found (the metrics' counters)

    # ---- sizes ----

    def local_span(self, start: int, end: int) -> tuple[int, int]:
        """Logical local pages [first, last] the queries at positions start..end-1 read."""
        first = max(0, start - self.window + 1) // self.page_size
        return first, (end - 1) // self.page_size

    def pages_needed(self, seq_id: int, start: int, end: int) -> tuple[int, int]:
        """(global, local) pages to take for sequence seq_id to compute positions start..end-1
        (after its local pages out of the window went back)."""
        sp = self.seqs.get(seq_id) or SeqPages()
        g = max(0, -(-end // self.page_size) - len(sp.global_pages)) if self.global_pool else 0
        loc = 0
        if self.local_pool is not None:
            first, last = self.local_span(start, end)
            have_end = sp.local_first + len(sp.local_pages)
            keep_from = max(first, sp.local_first)
            loc = last + 1 - max(keep_from, have_end) if last >= max(keep_from, have_end) else 0
        return g, loc

    def fits(self, need: tuple[int, int], freed: tuple[int, int] = (0, 0)) -> bool:
        g, loc = need
        ok = self.global_pool is None or g <= self.global_pool.num_free + freed[0]
        return ok and (self.local_pool is None or loc <= self.local_pool.num_free + freed[1])

    def held(self, seq_id: int) -> tuple[int, int]:
        sp = self.seqs.get(seq_id)
        if sp is None:
            return 0, 0
        return len(sp.global_pages), len(sp.local_pages)

    def usage(self) -> float:
        """Fraction of pages held by sequences (cached pages no one holds are free)."""
        pools = [p for p in (self.global_pool, self.local_pool) if p is not None]
        used = sum(p.num_pages - 1 - p.num_free for p in pools)
        return used / max(1, sum(p.num_pages - 1 for p in pools))

    # ---- prefix cache ----

    def lookup_prefix(self, hashes: list[bytes], limit: int) -> int:
        """How many leading pages (at most `limit`) of a prompt with these page hashes are
        cached in both pools (global pages 0..n-1, local pages of the window before n*P)."""
        n = 0
        if self.global_pool is not None:
            while n < min(limit, len(hashes)) and self.global_pool.lookup(hashes[n]) is not None:
                n += 1
        else:
            n = min(limit, len(hashes))
        while n and self.local_pool is not None:
            first = max(0, n * self.page_size - self.window) // self.page_size
            if all(self.local_pool.lookup(hashes[j]) is not None for j in range(first, n)):
                break
            n -= 1
        return n

    def attach_prefix(self, seq_id: int, hashes: list[bytes], n: int) -> None:
        """A new sequence takes the n cached leading pages (looked up just before) by reference."""
        sp = self.seqs.setdefault(seq_id, SeqPages())
        assert not sp.global_pages and not sp.local_pages, "prefix attached to a running sequence"
        if self.global_pool is not None:
            for j in range(n):
                page = self.global_pool.lookup(hashes[j])
                self.global_pool.hold(page)
                sp.global_pages.append(page)
        if self.local_pool is not None and n:
            first = max(0, n * self.page_size - self.window) // self.page_size
            sp.local_first = first
            for j in range(first, n):
                page = self.local_pool.lookup(hashes[j])
                self.local_pool.hold(page)
                sp.local_pages.append(page)
        sp.named = n

    def name_full_pages(self, seq_id: int, hashes: list[bytes], computed: int) -> None:
        """Registers the sequence's full pages below position `computed` under their hashes
        (`hashes` covers the prompt's full pages; generated tokens are not cached)."""
        sp = self.seqs.get(seq_id)
        if sp is None:
            return
        full = min(computed // self.page_size, len(hashes))
        for j in range(sp.named, full):
            if self.global_pool is not None:
                self.global_pool.name(sp.global_pages[j], hashes[j])
            if self.local_pool is not None and j >= sp.local_first:
                self.local_pool.name(sp.local_pages[j - sp.local_first], hashes[j])
        sp.named = max(sp.named, full)

    # ---- growing and freeing ----

    def allocate(self, seq_id: int, start: int, end: int) -> None:
        """Gives sequence seq_id the pages to compute positions start..end-1: local pages out of
        the window go back first. Check `can_allocate` before: MemoryError otherwise
        (nothing is changed then)."""
        if not self.can_allocate(seq_id, start, end):
            raise MemoryError(f"not enough free KV-cache pages for positions {start}..{end - 1}")
        sp = self.seqs.setdefault(seq_id, SeqPages())
        if self.global_pool is not None:
            while len(sp.global_pages) * self.page_size < end:
                sp.global_pages.append(self.global_pool.take())
        if self.local_pool is not None:
            first, last = self.local_span(start, end)
            self._slide(sp, first)
            if not sp.local_pages:
                sp.local_first = first
            while sp.local_first + len(sp.local_pages) <= last:
                sp.local_pages.append(self.local_pool.take())

    def can_allocate(self, seq_id: int, start: int, end: int) -> bool:
        """Whether `allocate(seq_id, start, end)` finds its pages (counting the local pages the
        window gives back first)."""
        return self.fits(self.pages_needed(seq_id, start, end), self._window_frees(seq_id, start))

    def _window_frees(self, seq_id: int, start: int) -> tuple[int, int]:
        sp = self.seqs.get(seq_id)
        if sp is None or self.local_pool is None:
            return 0, 0
        first = self.local_span(start, start + 1)[0]
        return 0, max(0, min(len(sp.local_pages), first - sp.local_first))

    def _slide(self, sp: SeqPages, first: int) -> None:
        """Returns the local pages before logical page `first` (out of every later query's window)."""
        while sp.local_pages and sp.local_first < first:
            self.local_pool.release(sp.local_pages.pop(0))
            sp.local_first += 1
        if not sp.local_pages:
            sp.local_first = max(sp.local_first, first)

    def free(self, seq_id: int) -> None:
        """The sequence ended or was preempted: every page it holds goes back (named pages stay
        cached until evicted)."""
        sp = self.seqs.pop(seq_id, None)
        if sp is None:
            return
        for page in sp.global_pages:
            self.global_pool.release(page)
        for page in sp.local_pages:
            self.local_pool.release(page)

    def reset(self) -> None:
        """Drops every sequence and every cached page (after an engine failure)."""
        for seq_id in list(self.seqs):
            self.free(seq_id)
        for pool in (self.global_pool, self.local_pool):
            if pool is not None:
                pool.clear_names()

    # ---- what the device step reads ----

    def slot(self, seq_id: int, position: int) -> tuple[int, int]:
        """(global, local) flat slot page * P + offset where position's keys/values are stored."""
        sp, p = self.seqs[seq_id], self.page_size
        g = sp.global_pages[position // p] * p + position % p if self.global_pool else 0
        loc = 0
        if self.local_pool is not None:
            loc = sp.local_pages[position // p - sp.local_first] * p + position % p
        return g, loc
