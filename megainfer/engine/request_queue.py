"""The scheduler's queues: an ordered set of requests with a deque's ends and O(1) removal of
any member (a request's ``n`` samples may be thousands; finishing or aborting one must not scan
them all). Members are keyed by identity (``Request`` compares by identity)."""
from __future__ import annotations

from collections import OrderedDict
from itertools import islice
from typing import Iterable, Iterator

from .request import Request


class RequestQueue:
    def __init__(self, items: Iterable[Request] = ()):
        self._items: OrderedDict[Request, None] = OrderedDict.fromkeys(items)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)

    def __contains__(self, req) -> bool:
        return req in self._items

    def __getitem__(self, i: int) -> Request:
        """``[0]`` the first, ``[-1]`` the last (O(1)); other indices walk the queue."""
        if not -len(self._items) <= i < len(self._items):
            raise IndexError(f"request queue index {i} out of range")
        it, k = (iter(self._items), i) if i >= 0 else (reversed(self._items), -i - 1)
        return next(islice(it, k, None))

    def append(self, req: Request) -> None:
        self._items[req] = None

    def appendleft(self, req: Request) -> None:
        self._items[req] = None
        self._items.move_to_end(req, last=False)

    def extendleft(self, reqs: Iterable[Request]) -> None:
        """As ``deque.extendleft``: each goes to the front in turn (the last ends up first)."""
        for r in reqs:
            self.appendleft(r)

    def popleft(self) -> Request:
        return self._items.popitem(last=False)[0]

    def pop(self) -> Request:
        return self._items.popitem()[0]

    def discard(self, req: Request) -> bool:
        """Remove ``req`` if queued here; whether it was."""
        if req not in self._items:
            return False
        del self._items[req]
        return True
