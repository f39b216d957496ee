"""Finding the plugin library on disk and in this process."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import List, Optional

from ._echo import echo_path
from ._files import is_file

log = logging.getLogger("nccl_lossy")

#: The file name NCCL looks for with ``NCCL_NET_PLUGIN=lossy``.
PACKAGED_NAME = "libnccl-net-lossy.so"
#: The file name Cargo gives the library.
CARGO_NAME = "libnccl_net_lossy.so"
#: The file name NCCL opens when ``NCCL_NET_PLUGIN`` is unset.
NCCL_DEFAULT_NAME = "libnccl-net.so"
#: Environment variable that overrides where the library is.
LIBRARY_ENV = "NCCL_LOSSY_LIBRARY"

_PACKAGE_DIR = Path(__file__).resolve().parent


class LibraryNotFoundError(FileNotFoundError):
    """The plugin library could not be found."""


def cargo_target_dir(repo: Path) -> Path:
    """Where Cargo builds the repository ``repo``: ``CARGO_TARGET_DIR`` when set (a relative
    one counts from the repository root, where Cargo runs), else ``<repo>/target``."""
    given = os.environ.get("CARGO_TARGET_DIR", "").strip()
    return repo / Path(given).expanduser() if given else repo / "target"


def _source_checkout_candidates() -> List[Path]:
    # An editable install or a run from the source tree: python/src/nccl_lossy -> repository.
    repo = _PACKAGE_DIR.parent.parent.parent
    if not (repo / "Cargo.toml").is_file():
        return []
    target = cargo_target_dir(repo)
    return [target / profile / CARGO_NAME for profile in ("release", "debug")]


def library_path() -> Path:
    """Absolute path of the plugin library this package uses.

    ``NCCL_LOSSY_LIBRARY`` wins when set; otherwise the copy packaged with ``nccl_lossy``;
    otherwise (running from a source checkout) the Cargo build output, in ``CARGO_TARGET_DIR``
    when that is set.
    """
    explicit = os.environ.get(LIBRARY_ENV)
    if explicit:
        path = Path(explicit).expanduser()
        if not is_file(path):
            raise LibraryNotFoundError(f"{LIBRARY_ENV}={echo_path(explicit)} does not name a file")
        return path.resolve()
    candidates = [_PACKAGE_DIR / "lib" / PACKAGED_NAME] + _source_checkout_candidates()
    for path in candidates:
        if path.is_file():
            return path.resolve()
    raise LibraryNotFoundError(
        "the nccl-net-lossy plugin library was not found (looked at "
        + ", ".join(str(p) for p in candidates)
        + f"). Reinstall the package after `cargo build --release --lib`, or set {LIBRARY_ENV}."
    )


def _is_plugin_file(path: str, any_net_plugin: bool = False) -> bool:
    name = os.path.basename(path)
    if any_net_plugin and name.startswith("libnccl-net") and ".so" in name:
        return True
    return name in (PACKAGED_NAME, CARGO_NAME)


def mapped_library_paths(maps_file: str = "/proc/self/maps", any_net_plugin: bool = False) -> List[str]:
    """Paths of plugin libraries mapped into this process (loaded by NCCL or by us): files
    under this plugin's names, or with ``any_net_plugin`` any ``libnccl-net*.so`` (NCCL's
    default ``libnccl-net.so`` among them), which may be this plugin renamed."""
    found: List[str] = []
    try:
        with open(maps_file, "r", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                parts = line.split(None, 5)
                if len(parts) == 6:
                    path = parts[5].strip()
                    if path.endswith(" (deleted)"):
                        path = path[: -len(" (deleted)")]
                    if _is_plugin_file(path, any_net_plugin) and path not in found:
                        found.append(path)
    except OSError:
        pass
    return found


def nccl_plugin_entries(value: Optional[str]) -> List[str]:
    """The entries of an ``NCCL_NET_PLUGIN`` value as NCCL reads them (``src/plugin/net.cc``):
    none for ``none`` (any case), else split at commas with ``strtok_r`` (empty entries
    skipped), each kept as it is: NCCL opens ``" lossy"`` with its space, which finds no file."""
    if not value or value.lower() == "none":
        return []
    return [item for item in value.split(",") if item]


def nccl_plugin_candidates(value: Optional[str]) -> List[str]:
    """The names NCCL's loader tries for an ``NCCL_NET_PLUGIN`` value, in order
    (``src/plugin/plugin_open.cc``)."""
    names: List[str] = []
    for item in nccl_plugin_entries(value):
        names.append(item)
        base = os.path.basename(item)
        if "/" not in item and not (base.startswith("lib") and base.endswith(".so")):
            names.append(f"libnccl-net-{item}.so")
    return names
