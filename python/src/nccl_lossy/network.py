"""The environment that makes NCCL use the lossy plugin: :class:`LossyNetwork`."""

from __future__ import annotations

import copy
import errno
import fnmatch
import json
import logging
import os
import stat
import warnings
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Set, Tuple, Union

from ._echo import SHOWN_CHARS, cut, echo, echo_path
from ._files import is_file, not_a_directory
from ._library import (
    CARGO_NAME,
    LIBRARY_ENV,
    PACKAGED_NAME,
    library_path,
    mapped_library_paths,
    nccl_plugin_entries,
)
from .config import LossyConfigError, loss_overrides

log = logging.getLogger("nccl_lossy")


#: Variables a :class:`LossyNetwork` sets from its ``profile``, ``set`` and ``stats_dir``; where
#: it leaves one at its default (None), :meth:`LossyNetwork.apply` keeps the environment's.
OWNED_VARIABLES = ("NCCL_LOSSY_PROFILE", "NCCL_LOSSY_SET", "NCCL_LOSSY_STATS")

#: How to settle a clash with the environment (ends every such error).
_RESOLVE = (
    "or keep the environment as it is (LossyMegatronIntegration(..., apply_env=False), or no "
    "LossyNetwork.apply())"
)

_PROTOCOLS = ("LL", "LL128", "SIMPLE")

SetLike = Union[None, str, Mapping[str, Any], Iterable[Tuple[str, Any]]]


class NcclAlreadyInitializedError(RuntimeError):
    """:meth:`LossyNetwork.apply` was called after NCCL started in this process."""


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def format_overrides(overrides: SetLike) -> str:
    """``NCCL_LOSSY_SET`` text for overrides given as a dict, pairs, or ready-made text."""
    if overrides is None:
        return ""
    if isinstance(overrides, str):
        return overrides.strip().strip(";")
    allowed = f"set={echo(overrides)}: allowed: None, 'key=value;...' text, a dict or (key, value) pairs"
    if isinstance(overrides, Mapping):
        items = list(overrides.items())
    else:
        try:
            items = list(overrides)
        except TypeError:
            raise LossyConfigError(allowed) from None
        if not all(isinstance(p, (tuple, list)) and len(p) == 2 for p in items):
            raise LossyConfigError(allowed)
    parts = []
    for key, value in items:
        key = str(key).strip()
        text = _format_value(value)
        if not key or any(c in key for c in ";= ") or ";" in text:
            raise LossyConfigError(f"override {echo(key)}={echo(text)}: keys are dotted names, values hold no ';'")
        parts.append(f"{key}={text}")
    return ";".join(parts)


def _split_overrides(text: str) -> List[str]:
    """``text`` cut at each ``;`` outside quotes, as the plugin cuts it (src/profile/tree.rs,
    ``split_overrides``): a quoted TOML string (``"..."`` with backslash escapes, or
    ``'...'``) may hold ``;``."""
    items, start, quote, escaped = [], 0, None, False
    for i, c in enumerate(text):
        if quote == '"' and escaped:
            escaped = False
        elif quote == '"' and c == "\\":
            escaped = True
        elif quote is not None:
            if c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif c == ";":
            items.append(text[start:i])
            start = i + 1
    if quote is not None:
        raise LossyConfigError(f"override {echo(text[start:].strip())}: unterminated {quote} quote")
    items.append(text[start:])
    return items


def parse_overrides(text: str) -> List[Tuple[str, str]]:
    """Splits ``NCCL_LOSSY_SET`` text into (key, value) pairs, at the ``;`` the plugin splits
    it at (not those inside a quoted value)."""
    pairs = []
    for item in _split_overrides(text):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep:
            raise LossyConfigError(f"override {echo(item)} has no '=' (expected dotted.key=value)")
        if "\0" in item:
            raise LossyConfigError(f"override {echo(item)} holds a NUL byte, which no environment "
                                   f"variable can carry; allowed: {key.strip()}=<text without NUL>")
        pairs.append((key.strip(), value.strip().strip("'\"")))
    return pairs


def _literal(value: str) -> Tuple[str, Any]:
    """An override's value as the profile reads it: integer, float or text (``0.020`` and
    ``0.02`` are one float; ``7`` and ``7.0`` are an integer and a float)."""
    for kind, convert in (("int", int), ("float", float)):
        try:
            return kind, convert(value)
        except ValueError:
            pass
    return "text", value


def same_overrides(a: str, b: str) -> bool:
    """Whether two ``NCCL_LOSSY_SET`` texts set the same keys to the same values; the plugin
    applies them in order, so a key given twice counts as its last value."""
    def settled(text: str) -> Dict[str, Tuple[str, Any]]:
        return {key: _literal(value) for key, value in parse_overrides(text)}

    return settled(a) == settled(b)


# Runs in a child interpreter so that the launcher's process never maps the plugin (NCCL
# must be the one to load it; see nccl_started_reason) and a crash there cannot take it down.
_CHECK_SCRIPT = """
import ctypes, os, sys
try:
    lib = ctypes.CDLL(sys.argv[1])
except OSError as err:
    sys.stderr.write(str(err))
    sys.exit(5)
if not hasattr(lib, "ncclLossyControlVersion"):
    sys.exit(6)
if not hasattr(lib, "ncclLossyCheckProfile"):
    sys.exit(3)
fn = lib.ncclLossyCheckProfile
fn.restype = ctypes.c_int64
fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
path = os.fsencode(sys.argv[2]) or None  # a path's bytes as they are, UTF-8 or not
cap = 1 << 16
while True:
    buf = ctypes.create_string_buffer(cap)
    n = fn(path, os.fsencode(sys.argv[3]), buf, cap)
    if n < 0:
        sys.exit(4)
    if n < cap:
        sys.stdout.write(buf.raw[:n].decode())
        break
    cap = n + 1
"""


def _not_a_profile(given: Any, path: Path) -> str:
    """Why ``path`` (the ``profile`` keyword ``given``, resolved) is no profile file: missing,
    a directory, or another kind of file."""
    try:
        mode = os.stat(path).st_mode
    except OSError as err:
        # A path longer than the system takes ("File name too long") names no file either.
        missing = err.errno in (errno.ENOENT, errno.ENOTDIR)
        what = "does not exist" if missing else f"cannot be looked at ({err.strerror})"
    else:
        what = "is a directory, not a file" if stat.S_ISDIR(mode) else "is not a regular file"
    return (
        f"profile={echo(given, SHOWN_CHARS)}: {echo_path(path)} {what}; allowed: the path of a TOML profile, or "
        "None for the plugin's embedded default"
    )


def check_profile(
    profile: Optional[Union[str, Path]],
    overrides: SetLike = None,
    library: Optional[Union[str, Path]] = None,
) -> Dict[str, Any]:
    """Loads a profile (None: the embedded default) with overrides exactly as the plugin will.

    Asks the plugin library itself (``ncclLossyCheckProfile``), so the answer follows its schema
    and defaults. Returns ``{"origin", "summary", "corrupts_data", "lossless", "profile"}``;
    raises :class:`LossyConfigError` with the plugin's message (file, line, key, allowed
    values) when the profile is wrong."""
    # Absolute: a name without a slash would be looked up on the loader's search path, not
    # in the current directory where the caller found it.
    lib = Path(library).expanduser().resolve() if library is not None else library_path()
    text = format_overrides(overrides)
    key = (str(lib), _file_key(lib), str(profile or ""), _file_key(profile), text)
    cached = _checked.get(key)
    if cached is not None:
        return json.loads(cached)
    answer = _check_in_child(lib, profile, text)
    _checked[key] = json.dumps(answer)
    return answer


# Answers of check_profile by (library, its size and time, profile, its size and time,
# overrides): the same question is answered once per process.
_checked: Dict[tuple, str] = {}


def _file_key(path: Optional[Union[str, Path]]) -> Optional[Tuple[int, int]]:
    if path is None or str(path) == "":
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns)


def _check_in_child(lib: Path, profile: Optional[Union[str, Path]], overrides: str) -> Dict[str, Any]:
    args = [sys.executable, "-c", _CHECK_SCRIPT, str(lib), str(profile or ""), overrides]
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise LossyConfigError(f"cannot check the profile with {lib}: {err}") from err
    # Which library: the library= keyword's, else NCCL_LOSSY_LIBRARY's or the packaged one.
    env_library = os.environ.get(LIBRARY_ENV, "")
    from_env = bool(env_library) and Path(env_library).expanduser().resolve() == lib
    named = f" ({LIBRARY_ENV}={env_library})" if from_env else ""
    allowed = "allowed: this plugin's library (libnccl-net-lossy.so)" + (
        f", or unset {LIBRARY_ENV}" if from_env else ""
    )
    if proc.returncode == 5:
        raise LossyConfigError(
            f"plugin library {lib}{named} cannot be loaded: {proc.stderr.strip()[-2000:]}; {allowed}"
        )
    if proc.returncode == 6:
        raise LossyConfigError(
            f"plugin library {lib}{named} is not this plugin: it has no control API "
            f"(ncclLossyControlVersion); {allowed}"
        )
    if proc.returncode == 3:
        raise LossyConfigError(
            f"plugin library {lib}{named} predates ncclLossyCheckProfile: install matching versions"
        )
    if proc.returncode != 0:
        raise LossyConfigError(f"checking the profile with {lib} failed: {proc.stderr.strip()[-2000:]}")
    try:
        answer = json.loads(proc.stdout)
    except ValueError as err:
        raise LossyConfigError(f"{lib} answered the profile check with bad JSON: {err}") from err
    if not answer.get("ok"):
        raise LossyConfigError(str(answer.get("error")))
    return answer


def protocol_guard_needed(
    profile: Optional[Union[str, Path]],
    overrides: SetLike = None,
    library: Optional[Union[str, Path]] = None,
) -> bool:
    """True when the profile (plus overrides) can corrupt data, so NCCL must use Simple only."""
    return bool(check_profile(profile, overrides, library)["corrupts_data"])


def allowed_protocols(nccl_proto: str) -> Set[str]:
    """Protocols an ``NCCL_PROTO`` value lets NCCL use for at least one collective.

    Read as NCCL 2.24+ reads it (``parseList`` in src/graph/tuning.cc): ``list`` or
    ``list;func:list;...``, each list naming the protocols to allow, or after ``^`` those to
    exclude; a collective that no entry names keeps NCCL's default, every protocol."""
    entries = [e.strip() for e in nccl_proto.split(";") if e.strip()]
    allowed: Set[str] = set()
    if not entries or ":" in entries[0]:
        allowed |= set(_PROTOCOLS)
    for entry in entries:
        text = entry.split(":", 1)[-1].strip()
        exclude = text.startswith("^")
        names = {p.strip().upper() for p in text.lstrip("^").split(",") if p.strip()}
        allowed |= set(_PROTOCOLS) - names if exclude else names & set(_PROTOCOLS)
    return allowed


#: ``intra_node`` choices: ``"net"`` sends the traffic between GPUs of one node through the
#: plugin too (NCCL never sends it through a net plugin otherwise: P2P, shared memory, NVLS);
#: ``"native"`` leaves NCCL's own transports, which the loss never touches.
INTRA_NODE_CHOICES = ("net", "native")


def _check_utf8(keyword: str, variable: str, value: Any) -> None:
    """Refuses a value the plugin cannot read: it reads ``variable`` as UTF-8 and refuses any
    other value at init (a path of a directory named in another encoding, given to Python as
    surrogate escapes)."""
    if value is None:
        return
    try:
        str(value).encode("utf-8")
    except UnicodeEncodeError:
        raise LossyConfigError(
            f"{keyword}={echo(str(value), SHOWN_CHARS)}: not valid UTF-8, and the plugin reads {variable} as UTF-8 "
            "only (it refuses another value at init); allowed: UTF-8 text (rename the directory "
            "or file, or choose another)"
        ) from None


def _check_stats_dir(path: Path) -> None:
    """Creates the statistics directory and checks that a file can be written in it (a probe,
    removed again), as ``lossy run --stats`` and the plugin's init do: a directory that cannot
    keep the statistics is refused before the launch, not by every rank's init."""
    _check_output_dir(path, "stats_dir", "statistics", "NCCL_LOSSY_STATS")


def _check_output_dir(path: Path, named: str, what: str, variable: str) -> None:
    """Creates ``path`` and writes a probe file in it (removed again), as the plugin's init
    does with its ``what`` directory; LossyConfigError starting ``{named}={path}`` otherwise."""
    allowed = (f"allowed: a directory this user can create and write (the plugin refuses "
               f"{variable} at init otherwise)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        why = "not a directory" if path.exists() and not path.is_dir() else err.strerror or str(err)
        raise LossyConfigError(f"{named}={echo_path(path)}: cannot create the {what} directory: {why}; "
                               f"{allowed}") from err
    probe = path / f".lossy-{what}-probe-{os.getpid()}.tmp"
    try:
        with open(probe, "x"):
            pass
        os.remove(probe)
    except OSError as err:
        raise LossyConfigError(f"{named}={echo_path(path)}: cannot write a file in it: "
                               f"{err.strerror or err}; {allowed}") from err


class LossyNetwork:
    """The environment a launcher needs to run NCCL through the lossy plugin.

    ``profile``: path of a TOML profile (None: the plugin's embedded default);
    ``set``: overrides, as ``{"model.rate": 0.01, "seed": 7}`` or ``"model.rate=0.01;seed=7"``;
    ``stats_dir``: directory for the per-rank statistics files (None: none written);
    ``loss_rate`` / ``burst_length``: the default loss model, as a fraction of packets lost in
    bursts of that many packets on average (1, or None: independent loss; see
    :func:`nccl_lossy.config.loss_overrides`); ``effect``: what a lost packet does
    (``"zero"``, ``"stale"``, ``"retransmit"``, ``"bitflip"``); ``intra_node``: ``"net"`` (the
    default) sends the traffic between GPUs of one node through the plugin, and so through the
    loss, by turning NCCL's P2P, shared-memory and NVLS transports off (a value the environment
    already holds is kept); ``"native"`` leaves them, for multi-node jobs where only the network
    between nodes should drop packets.

    Everything is checked here, by the plugin library itself (:meth:`check`): a wrong value
    raises :class:`LossyConfigError` naming the key, the value and what is allowed.
    """

    def __init__(
        self,
        profile: Optional[Union[str, Path]] = None,
        set: SetLike = None,  # noqa: A002 - mirrors NCCL_LOSSY_SET
        stats_dir: Optional[Union[str, Path]] = None,
        library: Optional[Union[str, Path]] = None,
        *,
        loss_rate: Optional[float] = None,
        burst_length: Optional[float] = None,
        effect: Optional[str] = None,
        intra_node: str = "net",
    ):
        if intra_node not in INTRA_NODE_CHOICES:
            raise LossyConfigError(
                f"intra_node={echo(intra_node)}: allowed: {', '.join(map(repr, INTRA_NODE_CHOICES))}"
            )
        self.intra_node = intra_node
        for keyword, value in (("profile", profile), ("stats_dir", stats_dir), ("library", library)):
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise LossyConfigError(f"{keyword}={echo(value)}: allowed: a path (str or os.PathLike) or None")
            if value is not None and "\0" in str(os.fspath(value)):
                raise LossyConfigError(f"{keyword}={echo(value, SHOWN_CHARS)}: holds a NUL byte, which no path can; "
                                       "allowed: a path (str or os.PathLike) or None")
        if profile is not None and not os.fspath(profile):
            # Path("") is the working directory, which exists: name the empty value instead.
            raise LossyConfigError(
                "profile='': names no file; allowed: the path of a TOML profile, or None for the "
                "plugin's embedded default"
            )
        self.profile = Path(profile).expanduser().resolve() if profile is not None else None
        loss = loss_overrides(loss_rate, burst_length, effect)
        user = parse_overrides(format_overrides(set))
        for key, _ in loss:
            clash = [k for k, _ in user if k == key or k.startswith(key + ".")]
            if clash:
                raise LossyConfigError(
                    f"set={echo(format_overrides(set))} overrides {echo(clash[0])}, which "
                    f"{'loss_rate' if key == 'model' else key}= sets too; allowed: one of the two"
                )
        self.loss_rate = loss_rate
        self.burst_length = burst_length
        self.effect = effect
        self.overrides = ";".join(p for p in (format_overrides(set), format_overrides(loss)) if p)
        self.stats_dir = Path(stats_dir).expanduser().resolve() if stats_dir is not None else None
        if self.stats_dir is not None and not_a_directory(self.stats_dir):
            # Said here: with apply_env=False nothing else looks at it before the per-step
            # file is written at disable().
            raise LossyConfigError(
                f"stats_dir={echo_path(self.stats_dir)}: {not_a_directory(self.stats_dir)}; allowed: a "
                "directory this user can create and write, or None"
            )
        self.library = Path(library).expanduser().resolve() if library is not None else None
        for keyword, variable, value in (("profile", "NCCL_LOSSY_PROFILE", self.profile),
                                         ("stats_dir", "NCCL_LOSSY_STATS", self.stats_dir),
                                         ("set", "NCCL_LOSSY_SET", self.overrides or None)):
            _check_utf8(keyword, variable, value)
        if self.profile is not None and not is_file(self.profile):
            raise LossyConfigError(_not_a_profile(profile, self.profile))
        self._checked: Optional[Dict[str, Any]] = None
        self.check()
        if loss_rate and burst_length in (None, 1):
            self._warn_bursts_replaced(format_overrides(set))

    def _warn_bursts_replaced(self, user_overrides: str) -> None:
        """``loss_rate`` without ``burst_length`` makes the default model uniform (documented);
        over a profile whose own default model loses packets in runs (Gilbert-Elliott, markov4,
        a trace), that is another condition than the file's, which is said."""
        own = check_profile(self.profile, user_overrides, self.library)
        model = ((own.get("profile") or {}).get("defaults") or {}).get("model") or {}
        kind = model.get("kind")
        if kind not in (None, "none", "uniform"):
            warnings.warn(
                f"loss_rate={self.loss_rate} replaces the default model of {own.get('origin')} "
                f"({kind}, losses that come in runs) with uniform loss (each packet on its "
                f"own); pass burst_length=... for losses in bursts",
                stacklevel=3,
            )

    def __repr__(self) -> str:
        return (
            f"LossyNetwork(profile={self.profile!s}, set={self.overrides!r}, "
            f"stats_dir={self.stats_dir!s})"
        )

    def check(self) -> Dict[str, Any]:
        """The plugin's reading of the profile (see :func:`check_profile`), computed once."""
        if self._checked is None:
            self._checked = check_profile(self.profile, self.overrides, self.library)
        return self._checked

    @property
    def intra_node_through_net(self) -> Dict[str, str]:
        """What ``intra_node="net"`` sets (a value the environment already holds is kept): the
        plugin library's own list, the one ``lossy run`` sets."""
        return self._library_table("intra_node_through_net")

    @property
    def intra_node_transports(self) -> Dict[str, str]:
        """NCCL's own transport each of :attr:`intra_node_through_net`'s variables leaves on
        when the environment keeps another value (the library's list, as ``lossy run`` says)."""
        return self._library_table("intra_node_transports")

    def _library_table(self, key: str) -> Dict[str, str]:
        """A name-to-text table of the library's ``ncclLossyCheckProfile`` answer."""
        listed = self.check().get(key)
        if not isinstance(listed, dict):
            raise LossyConfigError(f"{self.library or library_path()} predates the intra-node "
                                   "settings of ncclLossyCheckProfile: install matching versions")
        return {str(k): str(v) for k, v in listed.items()}

    @property
    def corrupts_data(self) -> bool:
        """True when the profile can corrupt data (the protocol guard applies)."""
        return bool(self.check()["corrupts_data"])

    def env(self, base: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
        """Variables to add to a launcher's environment (``base``: the environment they join,
        ``os.environ`` by default, consulted only for a user's own ``NCCL_PROTO``). These are
        this object's own values; ``resolved(base).env(base)`` takes the variables ``base``
        already holds into account (what :meth:`apply` does)."""
        base = _base_environment(base)
        lib = self.library or library_path()
        env = {"NCCL_NET_PLUGIN": str(lib), "NCCL_NET": "lossy"}
        if self.profile is not None:
            env["NCCL_LOSSY_PROFILE"] = str(self.profile)
        if self.overrides:
            env["NCCL_LOSSY_SET"] = self.overrides
        if self.stats_dir is not None:
            _check_stats_dir(self.stats_dir)
            env["NCCL_LOSSY_STATS"] = str(self.stats_dir)
            # Said before the run, while the earlier files can still be moved (as `lossy run`
            # says it): after it, the readers only find both runs' files summed.
            # This process's own file (apply() again after NCCL wrote it) is no earlier run.
            own = f"-{os.getpid()}.json"
            earlier = len([name for name in fnmatch.filter(os.listdir(self.stats_dir), "lossy-stats-*.json")
                           if not name.endswith(own)])
            if earlier:
                warnings.warn(
                    f"stats_dir {self.stats_dir} already holds {earlier} statistics "
                    f"file{'' if earlier == 1 else 's'} (an earlier run's?): this run's files go "
                    "beside them and read_stats() and lossy report sum every file in the "
                    "directory; give each run its own",
                    stacklevel=2,
                )
        if self.intra_node == "net":
            transports = self.intra_node_transports
            for key, value in self.intra_node_through_net.items():
                kept = base.get(key, "").strip()
                if not kept:
                    env[key] = value
                elif kept != value:
                    # The user's own choice stands; one that leaves NCCL's own transport on is
                    # said, since that traffic never meets the loss (as `lossy run` notes).
                    warnings.warn(
                        f"{key}={cut(kept)} is kept (intra_node='net' sets {value}): NCCL may move the "
                        f"traffic between GPUs of one node over {transports[key]}, "
                        "which the loss never touches; unset it to send that traffic through "
                        "the plugin",
                        stacklevel=2,
                    )
        self._check_wrap(base)
        self._check_trace(base)
        if self.corrupts_data:
            user_proto = base.get("NCCL_PROTO")
            if user_proto is None or not user_proto.strip():
                env["NCCL_PROTO"] = "Simple"
            else:
                risky = allowed_protocols(user_proto) & {"LL", "LL128"}
                if risky:
                    raise LossyConfigError(
                        f"the profile corrupts data ({self.check()['summary']}), which "
                        f"hangs NCCL's {'/'.join(sorted(risky))} protocol, but NCCL_PROTO="
                        f"{cut(user_proto)} allows it: unset NCCL_PROTO or set it to Simple"
                    )
        return env

    def _check_trace(self, base: Mapping[str, str]) -> None:
        """Refuses the trace settings the plugin refuses at init, as ``lossy run`` does: a ring
        size (``NCCL_LOSSY_TRACE_EVENTS``) out of range, and a trace directory
        (``NCCL_LOSSY_TRACE``, else the profile's ``trace``) that cannot be created or
        written."""
        resolved = self.check()
        if "max_trace_events" not in resolved:
            return  # a library that predates these fields: its init is the check
        limit = int(resolved["max_trace_events"])
        events = (base.get("NCCL_LOSSY_TRACE_EVENTS") or "").strip()
        # As Rust's i64 parse reads it: an optional sign and ASCII digits (int() would also
        # take "1_000" and other scripts' digits).
        digits = events[1:] if events[:1] in ("+", "-") else events
        number = int(events) if digits.isascii() and digits.isdigit() else None
        if events and not (number is not None and 1 <= number <= limit):
            raise LossyConfigError(
                f"NCCL_LOSSY_TRACE_EVENTS={cut(base['NCCL_LOSSY_TRACE_EVENTS'])}: must be an integer in "
                f"[1, {limit}] (messages the trace ring holds)"
            )
        env_dir = base.get("NCCL_LOSSY_TRACE") or ""
        if env_dir.strip():
            _check_output_dir(Path(env_dir), "NCCL_LOSSY_TRACE", "trace", "NCCL_LOSSY_TRACE")
        elif resolved.get("trace"):
            named = f"trace (profile {resolved['origin']})"
            _check_output_dir(Path(resolved["trace"]), named, "trace", "the profile's trace")

    def _check_wrap(self, base: Mapping[str, str]) -> None:
        """Refuses what the plugin refuses at init in wrap mode, as ``lossy run`` does: a
        profile with ``transport = "wrap"`` that names no ``inner`` while ``base`` has no
        ``NCCL_LOSSY_INNER``, or ``NCCL_LOSSY_INNER`` under ``transport = "socket"``."""
        resolved = self.check()
        transport = resolved["profile"].get("transport")
        inner_env = (base.get("NCCL_LOSSY_INNER") or "").strip()
        if transport == "socket" and inner_env:
            raise LossyConfigError(
                f"NCCL_LOSSY_INNER={echo_path(inner_env)} asks to wrap a net plugin, but the profile "
                f'({resolved["origin"]}) says transport = "socket"; unset one of them'
            )
        if transport == "wrap" and not inner_env and not resolved["profile"].get("inner"):
            raise LossyConfigError(
                f'the profile ({resolved["origin"]}) says transport = "wrap" but names no plugin '
                "to wrap: set `inner` in the profile (or set={'inner': ...}) or NCCL_LOSSY_INNER "
                '(a path, or a name like "ib")'
            )

    def resolved(self, base: Optional[Mapping[str, str]] = None) -> "LossyNetwork":
        """The network NCCL will see once :meth:`apply` has run in ``base`` (``os.environ`` by
        default): a copy of this one with what it leaves at the default taken from ``base``.

        A launcher (``lossy run``, the user's shell) may have set the variables already:

        - ``NCCL_LOSSY_PROFILE``, ``NCCL_LOSSY_SET``, ``NCCL_LOSSY_STATS``: used where this
          object has no ``profile``, ``set`` (nor loss keywords), ``stats_dir``; where it has
          one that differs, :class:`LossyConfigError` names the variable and both values;
        - ``NCCL_NET_PLUGIN``: kept when it names this plugin (``lossy``, or a file named
          ``libnccl-net-lossy.so`` / ``libnccl_net_lossy.so``); a path that is no file, another
          plugin, or (with ``library``) another file than ``library`` is refused;
        - ``NCCL_NET``: anything but ``lossy`` is refused (NCCL would use another network).

        The copy is checked by the plugin library (:meth:`check`), so the protocol guard of
        :meth:`env` follows the profile and overrides actually in force."""
        base = _base_environment(base)
        net = copy.copy(self)
        changed = False

        profile = _from_env(base, "NCCL_LOSSY_PROFILE")
        if profile is not None:
            path = Path(profile).resolve()  # as the plugin reads it: no "~"
            if self.profile is None:
                if not is_file(path):
                    tilde = " (the plugin does not expand '~')" if profile.startswith("~") else ""
                    raise LossyConfigError(
                        f"NCCL_LOSSY_PROFILE={echo_path(profile)} (in the environment) does not name a file"
                        f"{tilde}; allowed: the path of a TOML profile; unset NCCL_LOSSY_PROFILE "
                        "for the plugin's embedded default"
                    )
                net.profile, changed = path, True
            elif path != self.profile:
                raise _clash("NCCL_LOSSY_PROFILE", profile, str(self.profile), "profile")

        overrides = _from_env(base, "NCCL_LOSSY_SET")
        if overrides is not None:
            theirs = format_overrides(overrides)
            try:
                parse_overrides(theirs)
            except LossyConfigError as err:
                # Named as the environment's: the code's set= is not where this text came from.
                raise LossyConfigError(
                    f"NCCL_LOSSY_SET={cut(overrides, SHOWN_CHARS)} (in the environment): {err}; allowed: "
                    f"key=value pairs separated by ';': unset NCCL_LOSSY_SET, {_RESOLVE}"
                ) from err
            if not self.overrides:
                net.overrides, changed = theirs, True
            elif not same_overrides(theirs, self.overrides):
                raise _clash("NCCL_LOSSY_SET", overrides, self.overrides, "set= (or the loss keywords)")

        stats = _from_env(base, "NCCL_LOSSY_STATS")
        if stats is not None:
            path = Path(stats).resolve()  # as the plugin reads it: no "~"
            if self.stats_dir is None:
                net.stats_dir = path
            elif path != self.stats_dir:
                raise _clash("NCCL_LOSSY_STATS", stats, str(self.stats_dir), "stats_dir")

        plugin = _from_env(base, "NCCL_NET_PLUGIN")
        if plugin is not None:
            first = plugin_entry(plugin) or ""
            if self.library is not None:
                if not any("/" in entry and os.path.isfile(entry) and os.path.samefile(entry, self.library)
                           for entry in nccl_plugin_entries(plugin)):
                    raise _clash("NCCL_NET_PLUGIN", plugin, str(self.library), "library")
            elif not first and plugin.lower() == "none":
                raise LossyConfigError(
                    f"NCCL_NET_PLUGIN={cut(plugin)} (in the environment) tells NCCL to load no "
                    "external plugin ('none', in any case), so this one would never run; "
                    "allowed: lossy, or the path of libnccl-net-lossy.so / libnccl_net_lossy.so: "
                    f"unset NCCL_NET_PLUGIN, {_RESOLVE}"
                )
            elif not first:
                raise LossyConfigError(
                    f"NCCL_NET_PLUGIN={echo_path(plugin)} (in the environment) names another library than "
                    f"this plugin ({library_path()}): NCCL would load it and find no lossy "
                    "network; allowed: lossy, or the path of libnccl-net-lossy.so / "
                    f"libnccl_net_lossy.so: unset NCCL_NET_PLUGIN, {_RESOLVE}"
                )
            elif "/" in first:
                if not os.path.isfile(first):
                    raise LossyConfigError(
                        f"NCCL_NET_PLUGIN={echo_path(plugin)} (in the environment): {echo_path(first)} does not exist, "
                        f"so NCCL cannot load the plugin; allowed: the path of a built plugin "
                        f"library: unset NCCL_NET_PLUGIN, {_RESOLVE}"
                    )
                net.library, changed = Path(first).resolve(), True

        network = _from_env(base, "NCCL_NET")
        if network is not None and network.lower() != "lossy":
            raise LossyConfigError(
                f"NCCL_NET={cut(network)} (in the environment) makes NCCL use another network than "
                f"the lossy plugin; allowed: NCCL_NET=lossy: unset NCCL_NET, {_RESOLVE}"
            )

        if changed:
            net._checked = None
            try:
                net.check()
            except LossyConfigError as err:
                raise LossyConfigError(f"the configuration in force with the environment's "
                                       f"NCCL_LOSSY_PROFILE/NCCL_LOSSY_SET/NCCL_NET_PLUGIN: {err}") from err
        return net

    def apply(self) -> Dict[str, str]:
        """Puts the environment of :meth:`resolved` in place in ``os.environ`` (call before
        ``torch.distributed`` starts NCCL) and returns the variables now in force.

        Only missing variables are set: a launcher's own (``lossy run``, the shell) are kept
        where this object leaves the value at its default, and a clash with a value this object
        sets raises :class:`LossyConfigError` (see :meth:`resolved`). When something is missing
        and NCCL is already running here, raises :class:`NcclAlreadyInitializedError`; when
        nothing is missing, nothing changes and NCCL having started does not matter."""
        net = self.resolved(os.environ)
        wanted = net.env(os.environ)
        missing = {k: v for k, v in wanted.items() if not os.environ.get(k, "").strip()}
        reason = nccl_started_reason() if missing else None
        if reason and not set(missing) - set(net.intra_node_through_net):
            # Only the intra-node settings are missing and NCCL already chose its transports:
            # the loss still applies between nodes; say what it does not reach.
            warnings.warn(
                f"NCCL is already running here ({reason}) without "
                f"{' '.join(f'{k}={v}' for k, v in missing.items())}: the traffic between GPUs "
                "of one node goes over NCCL's own transports, which the loss never touches (set "
                "them before torch.distributed starts NCCL, or pass intra_node='native')",
                stacklevel=2,
            )
            for key in missing:
                wanted.pop(key)
            missing = {}
        if missing:
            if reason:
                raise NcclAlreadyInitializedError(
                    f"cannot switch NCCL to the lossy plugin: {reason}, and the environment "
                    f"lacks {' '.join(f'{k}={v}' for k, v in missing.items())}. NCCL reads its "
                    "plugin settings once; call LossyNetwork.apply() (or "
                    "LossyMegatronIntegration.enable()) before torch.distributed."
                    "init_process_group, or pass LossyNetwork.env() to the launcher (torchrun); "
                    "when the launcher set the environment itself, pass apply_env=False to "
                    "LossyMegatronIntegration."
                )
            os.environ.update(missing)
        in_force = {k: os.environ[k] for k in wanted}
        kept = [k for k in wanted if k not in missing]
        log.info(
            "lossy network environment: %s%s",
            " ".join(f"{k}={v}" for k, v in in_force.items()),
            f" (kept from the environment: {', '.join(kept)})" if kept else "",
        )
        return in_force


def names_this_plugin(value: str) -> bool:
    """Whether an ``NCCL_NET_PLUGIN`` value makes NCCL load this plugin (with
    ``NCCL_NET=lossy``): one of its entries names it (:func:`plugin_entry`)."""
    return plugin_entry(value) is not None


def plugin_entry(value: str) -> Optional[str]:
    """The first entry of an ``NCCL_NET_PLUGIN`` value that names this plugin: ``lossy`` (NCCL
    opens ``libnccl-net-lossy.so``), a file named ``libnccl-net-lossy.so`` /
    ``libnccl_net_lossy.so``, or a file under another name that exports this plugin's control
    API (a renamed copy). NCCL loads every entry in order and gives a communicator the first
    whose network is named ``NCCL_NET`` (``ncclNetInit`` in ``src/plugin/net.cc``), so an
    entry after another plugin's is the one used."""
    for entry in nccl_plugin_entries(value):
        if entry == "lossy" or os.path.basename(entry) in (PACKAGED_NAME, CARGO_NAME):
            return entry
        if "/" in entry and _exports_control_api(entry):
            return entry
    return None


#: A name only this plugin's library exports (``nccl_headers/nccl_lossy_control.h``): its
#: dynamic symbol table holds the string.
_CONTROL_SYMBOL = b"ncclLossySetEnabled"


def _exports_control_api(path: str) -> bool:
    """Whether the file at ``path`` names this plugin's control API, read without loading it
    (loading runs the library's constructors, and a foreign plugin's may not expect that)."""
    try:
        if not os.path.isfile(path):
            return False
        with open(path, "rb") as f:
            tail = b""
            while True:
                block = f.read(1 << 20)
                if not block:
                    return False
                if _CONTROL_SYMBOL in tail + block:
                    return True
                tail = block[-len(_CONTROL_SYMBOL):]
    except OSError:
        return False


def _base_environment(base: Any) -> Mapping[str, str]:
    """``base`` as the environment to read (``os.environ`` when None); what is no mapping is
    a LossyConfigError naming it."""
    if base is None:
        return os.environ
    if not isinstance(base, Mapping):
        raise LossyConfigError(f"base={echo(base)}: allowed: a mapping of environment variables "
                               "(os.environ, a dict of str to str) or None for os.environ")
    return base


def _from_env(base: Mapping[str, str], name: str) -> Optional[str]:
    """``base[name]``, None when unset or blank (the plugin reads a blank value as unset)."""
    value = base.get(name)
    return value if value is not None and value.strip() else None


def _clash(name: str, theirs: str, mine: str, keyword: str) -> LossyConfigError:
    return LossyConfigError(
        f"{name}: the environment has {name}={cut(theirs, SHOWN_CHARS)} (set by the launcher or the shell), the "
        f"code asks for {cut(mine, SHOWN_CHARS)} ({keyword}); NCCL can use only one. Allowed: one value: unset "
        f"{name}, leave {keyword} out to use the environment's, {_RESOLVE}"
    )


def torch_nccl_reason() -> Optional[str]:
    """What says torch.distributed started NCCL in this process, or None."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None:
        try:
            if dist.is_available() and dist.is_initialized():
                backend = str(dist.get_backend()).lower()
                if "nccl" in backend:
                    return f"torch.distributed is initialised with the {backend} backend"
        except Exception as err:  # a half-initialised torch: say what we saw, don't guess
            log.debug("could not query torch.distributed: %s", err)
    return None


def nccl_started_reason() -> Optional[str]:
    """Why NCCL counts as started in this process, or None when it has not started."""
    reason = torch_nccl_reason()
    if reason is not None:
        return reason
    from . import control as _control_module

    ours = _control_module._control
    for path in mapped_library_paths():
        if ours is not None and ours.source != "mapped":
            continue  # we loaded it ourselves for the control API; NCCL has not
        return f"the plugin library {path} is already loaded in this process"
    return None
