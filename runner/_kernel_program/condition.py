"""A condition variable on _thread's locks: the threading module costs 5-21 ms to import in the sandbox."""

from __future__ import annotations

import _thread

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


class _Condition:
    """threading.Condition's `with`, wait(timeout) and notify_all(), on _thread's locks."""

    def __init__(self) -> None:
        self._lock = _thread.allocate_lock()
        self._waiters: list[Any] = []

    def __enter__(self) -> _Condition:
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        """Called holding the lock; gives it up until notified (or the timeout), then takes it back."""
        waiter = _thread.allocate_lock()
        waiter.acquire()
        self._waiters.append(waiter)
        self._lock.release()
        got = False
        try:
            got = waiter.acquire(True, -1 if timeout is None else timeout)
        finally:
            self._lock.acquire()
            if not got and waiter in self._waiters:
                self._waiters.remove(waiter)
        return got

    def notify_all(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.release()
