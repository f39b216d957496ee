"""Writing the files this package leaves for other programs to read."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import Callable, Union

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _kind(mode: int) -> str:
    """What a file that is not a regular one is, for errors: "a directory", "a FIFO", ..."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((name for test, name in _KINDS if test(mode)), "special")


def is_file(path: Union[str, Path]) -> bool:
    """``Path.is_file()``, False also where the path cannot be looked at (longer than the
    system takes: ``Path.is_file()`` raises "File name too long" there)."""
    try:
        return Path(path).is_file()
    except OSError:
        return False


def not_a_directory(path: Union[str, Path]) -> str:
    """"not a directory (a FIFO)" when ``path`` is there as something else than a directory
    (links followed), else ""."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return ""
    return "" if stat.S_ISDIR(mode) else f"not a directory ({_kind(mode)})"


def read_regular_file(file: Union[str, Path], limit: int, allowed: str,
                      error: Callable[[str], Exception]) -> bytes:
    """The bytes of ``file``, which must be a regular file of at most ``limit`` bytes, else
    ``error`` of a message naming the file, what it is, and ``allowed``.

    Opened without blocking and checked on the open descriptor: a FIFO would block the reader
    for ever and ``/dev/zero`` never end."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        # A socket cannot be opened (ENXIO, "No such device or address"), which reads as if
        # it were missing: say what is there instead.
        try:
            mode = os.stat(file).st_mode
        except OSError:
            raise err from None
        if stat.S_ISREG(mode):
            raise
        raise error(f"{file}: not a regular file ({_kind(mode)}); {allowed}") from err
    try:
        # Checked before os.fdopen, which refuses a directory with an error naming the
        # descriptor's number instead of the file.
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{file}: not a regular file ({_kind(st.st_mode)}); {allowed}")
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        if st.st_size > limit:
            raise error(f"{file}: {st.st_size} bytes, larger than the limit; {allowed}")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise error(f"{file}: grew past the limit while read; {allowed}")
    return data


def write_atomically(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` through a temporary of this write's own in the same
    directory, renamed over ``path``: a reader sees the old file or the whole new one, and
    writers at the same time never share a temporary (the last rename wins). The temporary
    is removed when the write fails."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
