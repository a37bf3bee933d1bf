"""Thread safety chosen at construction: a manager class whose public methods
hold the manager's lock, beside the lock-free class they extend.

``KVCacheManager(..., thread_safe=True)`` builds an instance of
``KVCacheManager.ThreadSafe``, made here with each manager class, so the
lock-free class pays nothing per call (no flag test, no wrapper) and both
copy and pickle the default way: the locked class is found by its qualified
name and the lock pickles as a fresh, unheld one.
"""

from __future__ import annotations

import functools
import inspect
import threading
import types
from collections.abc import Callable
from typing import Any

__all__ = ["LOCKED_NAME", "ManagerLock", "locked_class", "public_methods"]

#: The attribute of a manager class that names its locked subclass; pickle
#: finds ``Manager.ThreadSafe`` by this name.
LOCKED_NAME = "ThreadSafe"


class ManagerLock:
    """The re-entrant lock of a thread-safe manager (``with mgr.lock:``).
    A deep copy or an unpickled manager gets a fresh, unheld lock of its
    own (a shallow copy shares the original's state, and so its lock)."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.RLock()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def __reduce__(self) -> tuple[type[ManagerLock], tuple[()]]:
        return (type(self), ())


def public_methods(cls: type) -> list[str]:
    """Names of ``cls``'s public instance methods (its own and inherited)."""
    names: dict[str, None] = {}
    for klass in cls.__mro__:
        if klass is object:
            continue
        for name, value in vars(klass).items():
            if not name.startswith("_") and inspect.isfunction(value):
                names[name] = None
    return list(names)


def _locked(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` run while holding its manager's ``lock``."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return method(self, *args, **kwargs)

    return run


def locked_class(cls: type) -> type:
    """The subclass of manager class ``cls`` whose public methods hold the
    manager's lock.  It is made with the class keyword ``locked=True``, which
    the manager's ``__init_subclass__`` reads so as not to lock it again."""
    # Only what the class resolves to a plain function is wrapped: a
    # subclass may turn an inherited method into a property or classmethod.
    namespace: dict[str, Any] = {
        name: _locked(method)
        for name in public_methods(cls)
        if inspect.isfunction(method := inspect.getattr_static(cls, name))
    }

    def body(ns: dict[str, Any]) -> None:
        ns.update(namespace)
        ns["__module__"] = cls.__module__
        ns["__qualname__"] = f"{cls.__qualname__}.{LOCKED_NAME}"
        ns["__doc__"] = f"{cls.__name__} whose public methods run under ``self.lock``."
        ns["thread_safe"] = True

    return types.new_class(LOCKED_NAME, (cls,), {"locked": True}, body)
