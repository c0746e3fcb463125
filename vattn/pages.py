"""The physical page layer under both allocators: page groups created within the budget,
kept spare, unmapped after their fences, released (failed releases kept for a retry) and
closed. Plain Python, no torch.

A *page group* is one page of each of the `num_buffers` buffers (K and V of every layer),
created, mapped, unmapped and released together: the unit both allocators count. The slot
allocator (`vattn.allocator`) and the elastic pool (`vattn.pool`) keep their own books of
where groups are mapped; every group is born and dies here. The slot allocator's layer
kinds (full attention, a sliding window, recurrent states) have groups of their own buffers
(`PageGroups` each) in one `PageLayer`: one participant of the budget, one backend, one
set of fences:

```
num_created = spare (created, not mapped) + mapped (the owner's books) + in flight (a worker's map)
budget bytes this participant holds = (num_created + len(unreleased)) * group_bytes
```

With a scratch backing (`back_with_scratch`, the elastic pool's tensors that another engine
reads), every page of the owner's buffers that holds no group is backed by the backend's
scratch memory: `map` replaces it (after the work enqueued so far, which may read it) and
`unmap` puts it back. The scratch is no group: neither `num_created` nor the budget counts it.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterable, Sequence

from vattn.errors import OutOfPhysicalMemoryError

if TYPE_CHECKING:
    from vattn.budget import Budget
    from vattn.vmem.base import Backend


class PageGroups:
    """The page groups of one cache or pool, and its place on a shared `Budget`.

    Bytes are taken from the budget before a group is created and given back once it is
    released. A group whose release the backend refused is still memory: it moves to
    `unreleased` (still counted by the budget, no longer by `num_created`) and is released
    again at `close`, which gives the budget everything back whatever failed.
    """

    def __init__(self, backend: Backend, bases: Sequence[int], page_size: int, num_buffers: int, *,
                 budget: Budget | None = None, reclaim: Callable[[int], int] | None = None,
                 cached: Callable[[], int] | None = None, device_sync: Callable[[], None] | None = None,
                 layer: PageLayer | None = None) -> None:
        """`reclaim(nbytes)` and `cached()` are the owner's budget callbacks (see `vattn.budget`);
        `device_sync` is called before every unmap (wait for every stream of the device).
        `layer`: the `PageLayer` these groups are one layer kind of (it holds the budget)."""
        self.backend = backend
        self.bases = list(bases)
        self.page_size = page_size
        self.num_buffers = num_buffers
        self.group_bytes = page_size * num_buffers
        self.device_sync = device_sync
        self.spare: list[Any] = []  # created, not mapped; pop() hands out the first created of a batch first
        self.num_created = 0
        self.unreleased: list[Any] = []  # released but refused by the backend: retried at close
        self.layer = layer
        self.budget = budget
        self.budget_short = 0  # most bytes the budget refused since take_budget_short()
        self.budget_token = budget.register(reclaim, cached) if budget is not None else None
        self.scratch: Any = None  # the backend's scratch memory under the pages with no group (back_with_scratch)
        self.num_pages = 0  # pages of each buffer the scratch backs

    def back_with_scratch(self, num_pages: int) -> None:
        """Back pages [0, num_pages) of every buffer (reserved-only now) with scratch memory,
        for good: reads and writes of a page with no group never fault from now on."""
        be = self.backend
        scratch = be.create_scratch(self.page_size, num_pages * self.num_buffers)
        try:
            be.map_scratch(self.bases, [p * self.page_size for p in range(num_pages)], self.page_size, scratch)
        except BaseException:  # nothing mapped (map_scratch is all or nothing)
            be.release_scratch(scratch)
            raise
        self.scratch, self.num_pages = scratch, num_pages

    # ---------------------------------------------------------------- creating ----
    def create(self, count: int, extra: int = 0, *,
               unlocked: ContextManager[Any] | None = None) -> list[Any] | None:
        """`count` new groups, and `extra` more where the budget and the device have room for
        them (fewer, larger creations). None when the budget cannot give `count` (nothing
        created); OutOfPhysicalMemoryError when the device cannot create them. The budget and
        driver calls run inside `unlocked` (a worker drops its owner's lock there); the
        counts change after it."""
        with unlocked if unlocked is not None else contextlib.nullcontext():
            groups = self._create(count, extra)
        if groups is not None:
            self.num_created += len(groups)
        return groups

    def _create(self, count: int, extra: int) -> list[Any] | None:
        if extra and not self._take_budget(count + extra):
            extra = 0
        if not extra and not self._take_budget(count):
            return None
        try:
            return self.backend.create(count + extra, self.num_buffers, self.page_size)
        except OutOfPhysicalMemoryError:
            self._give_budget(extra)
            if not extra:  # the device is short of what is needed
                self._give_budget(count)
                raise
        except BaseException:
            self._give_budget(count + extra)
            raise
        try:  # the larger batch did not fit; what is needed may
            return self.backend.create(count, self.num_buffers, self.page_size)
        except BaseException:
            self._give_budget(count)
            raise

    def _take_budget(self, num_groups: int) -> bool:
        nbytes = num_groups * self.group_bytes
        if self.layer is not None:
            return self.layer.take_budget(nbytes)
        if self.budget is None or self.budget.try_take(nbytes):
            return True
        self.budget_short = max(self.budget_short, nbytes)
        return False

    def _give_budget(self, num_groups: int) -> None:
        if self.layer is not None:
            self.layer.give_budget(num_groups * self.group_bytes)
        elif self.budget is not None and num_groups:
            self.budget.give(num_groups * self.group_bytes)

    def take_budget_short(self) -> int:
        """The most bytes the budget refused since the last call (0: none), to ask the other
        participants for (`Budget.reclaim`) outside the owner's lock."""
        short, self.budget_short = self.budget_short, 0
        return short

    # ------------------------------------------------------------------- spare ----
    def take_spare(self, count: int) -> list[Any]:
        """Take `count` spare groups, in the order they are handed out."""
        spare = self.spare
        return [spare.pop() for _ in range(count)]

    def put_spare(self, groups: Sequence[Any]) -> None:
        """Make `groups` spare; the first of them is handed out first."""
        self.spare.extend(reversed(groups))

    # ---------------------------------------------------------------- mapping ----
    def map(self, offsets: Sequence[int], groups: Sequence[Any]) -> None:
        """Map groups[i] at offsets[i] of every buffer (one backend call, all or nothing).
        Over a scratch backing, first wait for the work enqueued so far: a GPU unmaps the
        scratch there, which kernels may read (an engine may read any block)."""
        if not groups:
            return
        if self.scratch is None:
            self.backend.map(self.bases, offsets, groups, self.page_size)
            return
        self.wait([self.backend.fence()])
        self.backend.map(self.bases, offsets, groups, self.page_size, self.scratch)

    def unmap(self, offsets: Sequence[int]) -> None:
        """Unmap the pages at `offsets` of every buffer (one backend call; the scratch backs
        them again where there is one). Wait for the fences of the work that may read them
        first (`wait`)."""
        if self.scratch is None:
            self.backend.unmap(self.bases, offsets, self.page_size)
        else:
            self.backend.unmap(self.bases, offsets, self.page_size, self.scratch)

    def fence(self) -> Any:
        """A marker of the device work enqueued so far (None where work is synchronous)."""
        return self.backend.fence()

    def wait(self, fences: Iterable[Any]) -> None:
        """Block until the work before each fence finished (each distinct fence once), and
        until the whole device finished where the owner asked for that (`device_sync`)."""
        seen: set[int] = set()
        for fence in fences:
            if fence is not None and id(fence) not in seen:
                seen.add(id(fence))
                self.backend.wait(fence)
        if self.device_sync is not None:
            self.device_sync()

    # --------------------------------------------------------------- releasing ----
    def release(self, groups: list[Any]) -> None:
        """Release unmapped groups and give their bytes back to the budget. Groups the
        backend refused to release are kept in `unreleased` (retried at close) and the error
        is raised."""
        if not groups:
            return
        self.num_created -= len(groups)
        try:
            self.backend.release(groups)
        except Exception:
            self.unreleased.extend(groups)  # still memory: the budget keeps counting it
            raise
        self._give_budget(len(groups))

    def release_spare(self, count: int) -> int:
        """Release the `count` spare groups that would be handed out next. Returns `count`."""
        groups = self.spare[len(self.spare) - count:] if count > 0 else []
        del self.spare[len(self.spare) - len(groups):]
        self.release(groups)
        return len(groups)

    def close(self, offsets: list[int], mapped: list[Any], fences: Iterable[Any] = ()) -> list[Exception]:
        """Give everything back: unmap `offsets` (after `fences` and all the device work
        enqueued so far), release the `mapped` groups (each once), the spare and the
        unreleased ones, give the budget back in full and leave it. Goes on past a failed
        call; returns the errors in order (the caller raises the first)."""
        errors: list[Exception] = []
        try:
            self.wait(fences)
            fence = self.backend.fence()
            if fence is not None:
                self.backend.wait(fence)
        except Exception as e:
            errors.append(e)
        if self.scratch is not None:  # every page goes, the scratch ones too
            offsets = [p * self.page_size for p in range(self.num_pages)]
        for _ in range(2):  # once more if the unmap failed (a transient error)
            try:
                self.backend.unmap(self.bases, offsets, self.page_size)
                break
            except Exception as e:
                errors.append(e)
        if self.scratch is not None:
            scratch, self.scratch = self.scratch, None
            try:
                self.backend.release_scratch(scratch)
            except Exception as e:
                errors.append(e)
        groups = list(mapped) + self.spare + self.unreleased
        self.spare, self.unreleased, self.num_created = [], [], 0
        try:
            self.backend.release(groups)
        except Exception as e:
            errors.append(e)
        if self.budget is not None:  # the participant leaves: whatever failed, its bytes go back
            self.budget.give(len(groups) * self.group_bytes)
            self.budget.unregister(self.budget_token)
        return errors


class PageLayer:
    """The slot allocator's page layer: the page groups of every layer kind of one cache
    (`kinds`, a `PageGroups` each: a kind's group is one page of each of its buffers), one
    participant of the budget and one backend (its fences, its device sync).

    ```
    created bytes = sum over kinds of num_created x group_bytes    (what the budget counts)
    ```
    The cache's own limit (its physical memory) is the allocator's to keep (it plans within
    it); the layer takes every created group's bytes from a shared `Budget`, when there is one.
    """

    def __init__(self, backend: Backend, page_size: int, *, budget: Budget | None = None,
                 reclaim: Callable[[int], int] | None = None, cached: Callable[[], int] | None = None,
                 device_sync: Callable[[], None] | None = None) -> None:
        self.backend = backend
        self.page_size = page_size
        self.device_sync = device_sync
        self.budget = budget
        self.budget_short = 0  # most bytes the budget refused since take_budget_short()
        self.budget_token = budget.register(reclaim, cached) if budget is not None else None
        self.kinds: list[PageGroups] = []

    def add_kind(self, bases: Sequence[int]) -> PageGroups:
        """The page groups of a layer kind whose buffers start at `bases` (one page each)."""
        groups = PageGroups(self.backend, bases, self.page_size, len(bases), device_sync=self.device_sync, layer=self)
        self.kinds.append(groups)
        return groups

    @property
    def created_bytes(self) -> int:
        """Bytes of the groups that exist, every kind's (what this cache holds of the budget,
        less the unreleased ones)."""
        return sum(k.num_created * k.group_bytes for k in self.kinds)

    def take_budget(self, nbytes: int) -> bool:
        if self.budget is None or not nbytes or self.budget.try_take(nbytes):
            return True
        self.budget_short = max(self.budget_short, nbytes)
        return False

    def give_budget(self, nbytes: int) -> None:
        if self.budget is not None and nbytes:
            self.budget.give(nbytes)

    def take_budget_short(self) -> int:
        """The most bytes the budget refused since the last call (0: none), to ask the other
        participants for (`Budget.reclaim`) outside the owner's lock."""
        short, self.budget_short = self.budget_short, 0
        return short

    def fence(self) -> Any:
        """A marker of the device work enqueued so far (None where work is synchronous)."""
        return self.backend.fence()

    def close(self, kinds: Sequence[tuple[list[int], list[Any]]]) -> list[Exception]:
        """Give everything back: per kind, unmap its `offsets` and release its `mapped` groups
        (see `PageGroups.close`), then give the budget back in full and leave it. Goes on past
        a failed call; returns the errors in order."""
        errors: list[Exception] = []
        nbytes = 0
        for groups, (offsets, mapped) in zip(self.kinds, kinds):
            nbytes += (len(mapped) + len(groups.spare) + len(groups.unreleased)) * groups.group_bytes
            errors += groups.close(offsets, mapped)
        if self.budget is not None:  # the participant leaves: whatever failed, its bytes go back
            self.budget.give(nbytes)
            self.budget.unregister(self.budget_token)
        return errors
