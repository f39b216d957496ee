"""Writing the files this package leaves for other programs to read."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


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
