"""Request ids for every protocol: unique within a process and across the --workers processes.

32 hex digits: a random per-process prefix and a counter. Unique like os.urandom(16).hex(), without a
getrandom() system call on every request; every process (each --workers worker is a fresh interpreter)
draws its own prefix when it imports this module. HTTP/1.1, the HTTP/2 bridge and gRPC all take theirs
from `new_request_id` (ids derived from object addresses repeat as soon as an object is freed).
"""

from __future__ import annotations

import itertools
import os
from typing import Callable


def request_id_source() -> Callable[[], str]:
    """A fresh id generator with its own random prefix (tests use it to model a second process)."""
    prefix = os.urandom(8).hex()
    counter = itertools.count()
    return lambda: f"{prefix}{next(counter):016x}"


new_request_id = request_id_source()

__all__ = ["new_request_id", "request_id_source"]
