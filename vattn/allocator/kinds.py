"""The layer kinds of a slot cache, each a spec and a manager (vLLM v1's `KVCacheSpec` and
`SingleTypeKVCacheManager`): the spec says what a kind is (its layout, its window or
chunk), the manager owns everything a kind does differently; the coordinator builds one
manager per spec through `vattn.allocator.registry.MANAGERS` and asks the managers, never
the spec's type. Plain Python, no torch.

```
manager         spec        a query at q reads from   a fork shares       given back
FullAttention   KindSpec    token 0                   whole prefix pages  never (deferred reclamation)
SlidingWindow   WindowSpec  q - window + 1            pages it reads      pages wholly behind the window
ChunkedLocal    ChunkSpec   q // chunk * chunk        pages it reads      whole chunks behind q's chunk
RecurrentState  StateSpec   (a state row, no tokens)  never: copied       with the slot (states.py)
```
A swap keeps what the next query reads (every token; a state row as it is).
A manager is its kind's `SlotBooks` (pages) and `Mapper` (movements) and the decisions that
differ: the pages a slot needs (its geometry's `pages_for`), the first page a query reads
(`first_needed`, `first_read`, `covers`), whether a fork or a swap-out may happen at a
length and what it shares or keeps (`can_fork`, `fork_parts`, `check_swap_out`,
`first_page`), what goes back behind a step (`gives_back`), and its part of a step
(`moves`, `after_step`, `reverted`). The plan (`plan.py`), sharing (`sharing.py`) and swap
(`swap.py`) code asks the manager; the books know nothing of windows.

A model's mapping names a layer's kind in `CacheConfig.layer_windows`: None (full attention),
an int (a sliding window of that many tokens) or a `LayerKind` (`Window`, `Chunk`), which
makes its kind's spec (`layer_spec`).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from vattn.allocator.books import SlotBooks
from vattn.allocator.mapper import Mapper
from vattn.errors import InvalidRequestError

if TYPE_CHECKING:
    from vattn.allocator.books import KindGeometry, Slots
    from vattn.allocator.snapshots import Snapshots
    from vattn.pages import PageGroups


# --------------------------------------------------------------------- specs ----
@dataclass(frozen=True)
class KindSpec:
    """One layer kind of a cache as the cache lays it out, full attention as such: its name
    ("full", "window=W", "chunk=C", "state"), byte layout and buffers (their base
    addresses). `zero_pages(offsets)` clears pages (zero_reused_pages); `copy_pages(pairs)`
    copies pages between offsets in every buffer of the kind (fork, snapshots)."""

    name: str
    geometry: KindGeometry
    bases: Sequence[int]
    zero_pages: Callable[[list[int]], None] | None = None
    copy_pages: Callable[[list[tuple[int, int]]], None] | None = None

    def layout(self) -> dict[str, Any]:
        """The fields every spec has (what a `LayerKind` builds its own spec from)."""
        return {f.name: getattr(self, f.name) for f in fields(KindSpec)}


@dataclass(frozen=True, kw_only=True)
class WindowSpec(KindSpec):
    """A sliding-window kind: a query sees its last `window` tokens (with the kernels'
    margin: what the pages must hold)."""

    window: int


@dataclass(frozen=True, kw_only=True)
class ChunkSpec(KindSpec):
    """A chunked-local-attention kind (Llama 4): a query sees the keys of its own chunk of
    `chunk` tokens only."""

    chunk: int


# ------------------------------------------------------- what a model names ----
@dataclass(frozen=True)
class LayerKind:
    """A layer kind a model's mapping names in `CacheConfig.layer_windows` beside None (full
    attention) and an int (a sliding window): a kind of `size` tokens that makes its own
    spec. Layers of equal `LayerKind`s are one kind of the cache."""

    size: int
    label = "kind"

    @property
    def name(self) -> str:
        return f"{self.label}={self.size}"

    def spec(self, base: KindSpec, margin: int) -> KindSpec:
        """This kind's spec on `base`'s layout; `margin`: tokens the device's kernels read
        before a window's first key."""
        raise NotImplementedError

    def entry(self) -> LayerKind | int:
        """What `CacheConfig.layer_windows` keeps for it (layers of equal entries are one kind)."""
        return self


class Window(LayerKind):
    """A sliding window of `size` tokens (what an int in `layer_windows` means)."""

    label = "window"

    def spec(self, base: KindSpec, margin: int) -> KindSpec:
        return WindowSpec(**base.layout(), window=self.size + margin)

    def entry(self) -> int:
        return self.size  # (an int: the same kind as the int it stands for)


class Chunk(LayerKind):
    """Chunked local attention of `size` tokens (Llama 4's `attention_chunk_size`): no margin,
    its attention reads exactly the query's chunk (`vattn.attention.sdpa_attention`)."""

    label = "chunk"

    def spec(self, base: KindSpec, margin: int) -> KindSpec:
        return ChunkSpec(**base.layout(), chunk=self.size)


def layer_kind(entry: Any) -> LayerKind | None:
    """An entry of `CacheConfig.layer_windows` as a `LayerKind` (None: full attention)."""
    if entry is None or isinstance(entry, LayerKind):
        return entry
    return Window(entry)


def layer_spec(entry: Any, base: KindSpec, margin: int) -> KindSpec:
    """The spec of the layers `entry` names (`layer_kind`), on `base`'s layout."""
    kind = layer_kind(entry)
    return base if kind is None else kind.spec(base, margin)


def layer_name(entry: Any) -> str:
    kind = layer_kind(entry)
    return "full" if kind is None else kind.name


# ------------------------------------------------------------------ managers ----
class KindManager:
    """A layer kind's books, mapper and decisions; the base decides as full attention does
    (every token kept, whole pages of a prefix shared, nothing given back)."""

    pinned_pages = True  # its pages are a prefix block's pages (`pin`, `map_pinned`)
    gives_back = False  # pages behind its queries' first key go back as a request grows
    sees_steps = False  # `after_step` does something (the coordinator skips it otherwise)
    snapshots: Snapshots | None = None  # the state kind's
    what = "full-attention"  # its layers, in messages

    def __init__(self, spec: KindSpec, books: SlotBooks, mapper: Mapper) -> None:
        self.spec = spec
        self.name = spec.name
        self.books = books
        self.mapper = mapper

    @classmethod
    def create(cls, spec: KindSpec, physical: PageGroups, slots: Slots, *, primary: bool) -> KindManager:
        """The manager of `spec`'s kind over `physical` (its groups of the page layer).
        `primary`: the first kind, whose pages `alloc_reqid` prefers (the warm slot)."""
        books = SlotBooks(spec.geometry, physical, slots, track_dirty=spec.zero_pages is not None,
                          primary=primary, name=spec.name)
        return cls(spec, books, Mapper(books, zero_pages=spec.zero_pages, copy_pages=spec.copy_pages))

    @property
    def geometry(self) -> Any:
        return self.books.geometry

    # --------------------------------------------------- what a query reads ----
    def first_needed(self, slot: int, new_len: int) -> int:
        """The first page an iteration taking `slot` to `new_len` tokens reads."""
        return 0

    def first_read(self, num_tokens: int) -> int:
        """The first page of a slot the query right after its first `num_tokens` tokens reads."""
        return 0

    def reads_held(self, slot: int, start: int) -> bool:
        """Whether `slot` still maps every key a query at position `start` sees."""
        return not self.books.lead[slot]

    def covers(self, holes: int, num_pages: int) -> bool:
        """Whether the first `num_pages` pages of a slot, of which the first `holes` were
        given back, hold every key a query right after them sees (a prefix mapped from
        pinned pages, or cut to that length)."""
        return not holes

    # ------------------------------------------------------------ a step ----
    def check_reads(self, lens: Mapping[int, int]) -> None:
        """InvalidRequestError (nothing moved) when the step `lens` would read pages given back."""

    def gives_back_now(self, lens: Mapping[int, int]) -> bool:
        """Whether the step `lens` gives pages back (lock held)."""
        return False

    def moves(self, lens: Mapping[int, int]) -> bool:
        """Whether the step `lens` must move this kind's pages though no slot is short:
        pages shared with a new owner, pages to clear (lock held)."""
        books = self.books
        return bool(books.shared_slots or books.dirty_slots)

    def after_step(self, slot: int, start: int, end: int, lens: Mapping[int, int]) -> None:
        """The step `lens` that takes `slot` from `start` to `end` tokens was served (`sees_steps`)."""

    def reverted(self, slot: int) -> None:
        """The last step's iteration will not run for `slot` (`Coordinator.revert_step`)."""

    # ------------------------------------------------------ fork and swap ----
    def can_fork(self, slot: int, num_tokens: int) -> bool:
        """Whether a fork of `slot` at `num_tokens` finds every page the child reads."""
        return True

    def fork_refused(self, parent: int, num_tokens: int) -> InvalidRequestError:
        """Why `can_fork(parent, num_tokens)` is False."""
        return InvalidRequestError(f"reqid {parent} cannot be forked at token {num_tokens}")

    def fork_parts(self, parent: int, child: int, num_tokens: int) -> tuple[tuple, tuple, tuple]:
        """(shares, maps, copies) that give `child` (empty) the first `num_tokens` tokens of
        `parent`: the groups of its whole pages, and spare groups for the rest (the partly
        filled last page; every page of a kind written in place, `geometry.shared_pages`),
        into which those pages are copied. A parent's holes stay holes in the child."""
        books, g = self.books, self.geometry
        full = g.shared_pages(num_tokens)  # whole pages: shared
        copy = g.pages_for(num_tokens) - full
        shares = ((child, 0, tuple(books.slot_pages[parent][:full])),) if full else ()
        if not copy:
            return shares, (), ()
        maps = ((child, full, copy),)
        copies = tuple((g.page_offset(parent, p), g.page_offset(child, p)) for p in range(full, full + copy))
        return shares, maps, copies

    def check_swap_out(self, slot: int, num_tokens: int) -> None:
        """InvalidRequestError where the slot's data cannot be parked at `num_tokens`."""

    def first_page(self, slot: int) -> int:
        """The first page `slot` maps (its live pages start there: a swap copies from it)."""
        return self.books.lead[slot]

    # -------------------------------------------------------------- slots ----
    def freed(self, slot: int) -> None:
        """`slot`'s request ended (lock held)."""
        self.books.freed(slot)

    def adopted(self, slot: int) -> None:
        """`slot` got its data from another slot or the host (fork, swap-in; lock held)."""

    def dropped(self, slot: int) -> None:
        """What a prefix hit put into `slot` before its first step is dropped (lock held,
        worker stopped): its pages are unmapped."""
        self.mapper.empty(slot)

    def check_invariants(self) -> None:
        """Assert this kind's books are consistent (lock held)."""
        self.books.check_invariants()
        if not self.gives_back:
            assert not any(self.books.lead), f"{self.name}: holes in a kind that gives nothing back"


class FullAttention(KindManager):
    """K/V of full-attention layers: every token kept; forks and prefixes share whole pages."""


class LocalAttention(KindManager):
    """K/V of layers whose query at position q reads keys from `first_key(q)` on: pages
    wholly behind that are given back as a request grows (holes at the start of its row),
    and forks and prefixes share only the pages a query still reads."""

    gives_back = True

    def first_key(self, q: int) -> int:
        """The first token a query at position `q` reads (nondecreasing in q)."""
        raise NotImplementedError

    def _page(self, token: int) -> int:
        g = self.books.geometry
        return token * g.token_bytes // g.page_size

    def first_needed(self, slot: int, new_len: int) -> int:
        """Its queries start at the previous step length (a step re-planned at the same
        length is the same iteration), and the first of them reads the least."""
        books = self.books
        slots, g = books.slots, books.geometry
        start = slots.prev_lens[slot] if new_len == slots.max_lens[slot] else slots.max_lens[slot]
        return self.first_key(min(start, new_len - 1)) * g.token_bytes // g.page_size  # (the step's hot path)

    def first_read(self, num_tokens: int) -> int:
        return self._page(self.first_key(num_tokens))

    def reads_held(self, slot: int, start: int) -> bool:
        holes = self.books.lead[slot]
        return not holes or holes <= self._page(self.first_key(start))

    def covers(self, holes: int, num_pages: int) -> bool:
        if not holes:
            return True
        g = self.books.geometry
        first = self.first_key(num_pages * g.page_size // g.token_bytes)  # the next query's first key
        return holes * g.page_size <= first * g.token_bytes  # (a token may straddle two pages)

    def check_reads(self, lens: Mapping[int, int]) -> None:
        """A slot stepped back behind its window or chunk would read pages given back."""
        books = self.books
        g, lead, max_lens = books.geometry, books.lead, books.slots.max_lens
        for s, n in lens.items():
            holes = lead[s]
            if holes and max_lens[s] and self.first_needed(s, n) < holes:
                raise InvalidRequestError(
                    f"reqid {s}'s {self.what} layers gave back the pages before token "
                    f"{holes * g.page_size // g.token_bytes} and this step reads from page "
                    f"{self.first_needed(s, n)}; an iteration's queries must start at the previous step's length "
                    "(free the request and compute it again)")

    def gives_back_now(self, lens: Mapping[int, int]) -> bool:
        lead = self.books.lead
        return any(self.first_needed(s, n) > lead[s] for s, n in lens.items())

    def moves(self, lens: Mapping[int, int]) -> bool:
        """Also pages to give back, or holes where a new owner reads."""
        lead = self.books.lead
        return super().moves(lens) or any(self.first_needed(s, n) != lead[s] for s, n in lens.items())

    def can_fork(self, slot: int, num_tokens: int) -> bool:
        return self.reads_held(slot, num_tokens)

    def fork_refused(self, parent: int, num_tokens: int) -> InvalidRequestError:
        return InvalidRequestError(
            f"reqid {parent}'s {self.what} layers gave back pages the child's first query (at token "
            f"{num_tokens}) reads: fork before the parent moves past it, or compute the prompt")

    def check_swap_out(self, slot: int, num_tokens: int) -> None:
        """The parked tokens must hold every key the request's next query (at `num_tokens`)
        reads: refused when pages it sees were given back (a count too far behind)."""
        if not self.reads_held(slot, num_tokens):
            raise InvalidRequestError(
                f"slot {slot}'s {self.what} layers gave back the pages before token "
                f"{self.geometry.tokens_in(self.books.lead[slot])}, which a request "
                f"resumed at {num_tokens} tokens reads: swap it out at a count they still hold (its length)")


class SlidingWindow(LocalAttention):
    """K/V of sliding-window layers: a query at q sees keys from q - window + 1 on."""

    what = "sliding-window"

    def __init__(self, spec: WindowSpec, books: SlotBooks, mapper: Mapper) -> None:
        super().__init__(spec, books, mapper)
        self.window = spec.window

    def first_key(self, q: int) -> int:
        return max(0, q - self.window + 1)


class ChunkedLocal(LocalAttention):
    """K/V of chunked local attention layers (Llama 4): a query at q sees the keys of its own
    chunk, from q // chunk * chunk on, so every whole chunk behind the current one goes back
    when the first query of a new chunk is planned (at the boundary, not a window later)."""

    what = "chunked-attention"

    def __init__(self, spec: ChunkSpec, books: SlotBooks, mapper: Mapper) -> None:
        super().__init__(spec, books, mapper)
        self.chunk = spec.chunk

    def first_key(self, q: int) -> int:
        return q // self.chunk * self.chunk


__all__ = ["Chunk", "ChunkSpec", "ChunkedLocal", "FullAttention", "KindManager", "KindSpec", "LayerKind",
           "LocalAttention", "SlidingWindow", "Window", "WindowSpec", "layer_kind", "layer_name", "layer_spec"]
