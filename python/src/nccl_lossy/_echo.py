"""Values as error messages echo them: cut, as the plugin cuts them (``src/error.rs``,
``echo``). Every rank prints an error, and a value of megabytes (an environment variable, a
generated argument) echoed whole made an error of megabytes."""

from __future__ import annotations

import os
from typing import Any, Callable

#: Most characters of a value, a key or a name an error message echoes (the plugin's
#: ``ECHO_CHARS``): past it, the first ones, "…", and how long the whole is.
ECHO_CHARS = 60
#: Most characters of a path an error message shows (the plugin's ``SHOWN_CHARS``): a path of
#: a file that exists is shorter (PATH_MAX), so it shows whole.
SHOWN_CHARS = 4096


def cut(text: str, chars: int = ECHO_CHARS, show: Callable[[str], str] = str) -> str:
    """``text`` written by ``show``: whole when it has at most ``chars`` characters, else its
    first ``chars`` and "…", followed by how long the whole is: ``'xxx…' (80001 bytes in
    all)``."""
    if len(text) <= chars:
        return show(text)
    size = len(text.encode("utf-8", "surrogatepass"))
    return f"{show(text[:chars] + '…')} ({size} bytes in all)"


def echo(value: Any, chars: int = ECHO_CHARS) -> str:
    """``repr(value)`` for an error message, cut past ``chars`` characters: text (a path's too)
    is cut and then quoted; anything else's repr is cut, saying how long it was."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str):
        return cut(value, chars, repr)
    try:
        text = repr(value)
    except Exception:  # a repr that fails must not hide the error that names the value
        return f"<{type(value).__name__}>"
    if len(text) <= chars:
        return text
    return f"{text[:chars]}… (a repr of {len(text)} characters in all)"


def echo_path(path: Any) -> str:
    """A path as an error message shows it (unquoted), cut past :data:`SHOWN_CHARS`."""
    return cut(os.fsdecode(os.fspath(path)) if isinstance(path, (bytes, os.PathLike)) else str(path),
               SHOWN_CHARS)
