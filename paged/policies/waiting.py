"""`QueueSnapshot`: the waiting jobs as a policy's `admit()` receives them (`waiting`), and as
`SchedulerView.sorted_waiting` returns them for it.

It is a list of the jobs as they were when the hook was called, whatever the policy starts or preempts meanwhile,
without copying the queue: it reads the scheduler's own list, which does not change while `admit()` runs (the
scheduler applies the hook's starts and preemptions to its lists when the hook returns). A queue of tens of
thousands of jobs is then not copied at every admission, where a policy looks at a few jobs at its front.

It behaves as a copy would: changing it (`sort`, `pop`, `del`, `append`, ...) changes a private copy made then, and
a snapshot still referenced when the hook returns takes its copy before the queue changes. It is a
`MutableSequence`, not a `list`: `list(waiting)` makes one; slices, `+` and `*` give lists.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, MutableSequence, Sequence
from typing import Any


class ReadOnlyJobs(Sequence):
    """A list of jobs read in place, without a copy: `len`, indexing (a slice is a list), iteration, `in`, `index`,
    `count`, `==`, and `+` / `*` giving lists; none of a list's mutators (`list(view)` makes a list of one's own).
    `SchedulerView.running` is one over the running jobs; `QueueSnapshot` adds copy-on-write changes."""

    __slots__ = ("_items",)

    def __init__(self, items: list):
        self._items = items

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i):
        return self._items[i]

    def __iter__(self):
        return iter(self._items)

    def __reversed__(self):
        return reversed(self._items)

    def __contains__(self, job) -> bool:
        return job in self._items

    def index(self, job, *args) -> int:
        return self._items.index(job, *args)

    def count(self, job) -> int:
        return self._items.count(job)

    def __eq__(self, other) -> bool:
        if isinstance(other, ReadOnlyJobs):
            return self._items == other._items
        return self._items == other if isinstance(other, list) else NotImplemented

    __hash__ = None  # (mutable, as a list)

    def __add__(self, other: Iterable) -> list:
        return self._items + list(other)

    def __radd__(self, other: Iterable) -> list:
        return list(other) + self._items

    def __mul__(self, n: int) -> list:
        return self._items * n

    __rmul__ = __mul__

    def __repr__(self) -> str:
        return repr(self._items)

    def copy(self) -> list:
        return list(self._items)


class QueueSnapshot(ReadOnlyJobs, MutableSequence):
    """A snapshot of a list of jobs that shares the list until either changes (see the module docstring).
    `registry`: where the snapshot records itself (a weak reference) while it shares the list, so that its owner
    can `detach` it before changing the list; None: `items` is the snapshot's own."""

    __slots__ = ("_registry", "__weakref__")

    def __init__(self, items: list, registry: list[weakref.ref] | None = None):
        super().__init__(items)
        self._registry = registry
        if registry is not None:
            registry.append(weakref.ref(self))

    @property
    def shared(self) -> bool:
        """Whether it still reads its owner's list (it has not been changed or detached)."""
        return self._registry is not None

    def detach(self) -> None:
        """Take a private copy of the jobs now (the shared list is about to change)."""
        if self._registry is not None:
            self._items = list(self._items)
            self._registry = None

    def _own(self) -> list:
        self.detach()
        return self._items

    def __copy__(self) -> QueueSnapshot:
        """Another snapshot of the same jobs, sharing the list while this one does."""
        if self._registry is None:
            return QueueSnapshot(list(self._items))
        return QueueSnapshot(self._items, self._registry)

    # (reading: `ReadOnlyJobs`, over the shared list)
    # ------------------------------------------------------------------ changing (a private copy)
    def __setitem__(self, i, value) -> None:
        self._own()[i] = value

    def __delitem__(self, i) -> None:
        del self._own()[i]

    def insert(self, i: int, job) -> None:
        self._own().insert(i, job)

    def append(self, job) -> None:
        self._own().append(job)

    def extend(self, jobs: Iterable) -> None:
        self._own().extend(jobs)

    def __iadd__(self, jobs: Iterable) -> QueueSnapshot:
        self._own().extend(jobs)
        return self

    def pop(self, i: int = -1):
        return self._own().pop(i)

    def remove(self, job) -> None:
        self._own().remove(job)

    def reverse(self) -> None:
        self._own().reverse()

    def clear(self) -> None:
        self._items, self._registry = [], None

    def sort(self, *, key: Callable[[Any], Any] | None = None, reverse: bool = False) -> None:
        self._own().sort(key=key, reverse=reverse)
