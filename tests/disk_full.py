"""A file on a disk that fills up, for tests of what a trace write failure does."""

from __future__ import annotations

import errno
import os

__all__ = ["Failing"]


class Failing:
    """The tracer's file, on a disk that fills up: from the ``after``-th write on, each
    write puts part of its bytes on disk and raises ENOSPC."""

    def __init__(self, file, after: int):
        self.file, self.after, self.writes = file, after, 0

    def write(self, data: bytes) -> int:
        self.writes += 1
        if self.writes >= self.after:
            self.file.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)
