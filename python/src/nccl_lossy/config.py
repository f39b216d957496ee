"""Checked configuration values: the loss keywords and the integration's config dict.

``loss_rate`` + ``burst_length`` describe the default loss model the way a researcher states
it (a fraction of packets lost, in bursts of this many packets on average): burst length 1 is
independent (uniform) loss, a longer one the Gilbert-Elliott model in its rate / mean-burst
form. :func:`loss_overrides` turns them, with ``effect``, into the plugin's ``NCCL_LOSSY_SET``
overrides. Every check raises :class:`LossyConfigError` naming the key, the value given and
what is allowed.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, List, Mapping, Optional, Tuple

from ._echo import echo

#: What the plugin does to a lost packet (the profile's ``effect``).
EFFECTS = ("zero", "stale", "retransmit", "bitflip")


class LossyConfigError(ValueError):
    """The profile, the overrides or the surrounding environment do not fit together."""


def _number(key: str, value: Any, allowed: str) -> float:
    # numbers.Real takes numpy's integer and float scalars (np.int64 from np.arange, np.float32
    # from a float32 array), which are no int or float subclasses; numpy's bool is no Real.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise LossyConfigError(f"{key}={echo(value)}: must be a number; allowed: {allowed}")
    number = float(value)
    if not math.isfinite(number):
        raise LossyConfigError(f"{key}={echo(value)}: must be finite; allowed: {allowed}")
    return number


def check_bool(key: str, value: Any) -> bool:
    """``value`` when it is a bool; otherwise :class:`LossyConfigError`."""
    if not isinstance(value, bool):
        raise LossyConfigError(f"{key}={echo(value)}: allowed: True or False")
    return value


def check_loss(
    loss_rate: Optional[Any], burst_length: Optional[Any], effect: Optional[Any]
) -> Tuple[Optional[float], Optional[float], Optional[str]]:
    """Checks the loss keywords; returns them as (float, float, str) with None kept."""
    rate = burst = None
    if loss_rate is not None:
        rate = _number("loss_rate", loss_rate, "a fraction in [0, 1]")
        if not 0.0 <= rate <= 1.0:
            raise LossyConfigError(f"loss_rate={echo(loss_rate)}: allowed: a fraction in [0, 1]")
    if burst_length is not None:
        burst = _number("burst_length", burst_length, "a number >= 1 (packets per loss burst)")
        if burst < 1.0:
            raise LossyConfigError(
                f"burst_length={echo(burst_length)}: allowed: a number >= 1 (packets per loss burst; "
                "1 is independent loss)"
            )
        if rate is None:
            raise LossyConfigError(
                f"burst_length={echo(burst_length)} needs loss_rate: allowed: burst_length together "
                "with loss_rate in [0, 1]"
            )
    if rate is not None and burst is not None and burst > 1.0 and rate > 0.0:
        limit = burst / (burst + 1.0)
        if rate > limit:
            raise LossyConfigError(
                f"loss_rate={echo(loss_rate)} with burst_length={echo(burst_length)}: allowed: loss_rate "
                f"<= B/(B+1) = {limit:.6g} for bursts of B packets on average (a burst has to end)"
            )
    name = None
    if effect is not None:
        if effect not in EFFECTS:
            raise LossyConfigError(f"effect={echo(effect)}: allowed: {', '.join(map(repr, EFFECTS))}")
        name = str(effect)
    return rate, burst, name


def _short(x: float) -> str:
    return repr(int(x)) if x.is_integer() else repr(x)


def loss_overrides(
    loss_rate: Optional[Any] = None, burst_length: Optional[Any] = None, effect: Optional[Any] = None
) -> List[Tuple[str, str]]:
    """``NCCL_LOSSY_SET`` pairs for the loss keywords (checked first; empty when all are None).

    ``loss_rate`` replaces the profile's default model: ``uniform`` when ``burst_length`` is
    None or 1, ``gilbert_elliott`` with ``rate`` and ``mean_burst`` otherwise, ``none`` for a
    rate of 0. Rules of the profile keep their own models."""
    rate, burst, name = check_loss(loss_rate, burst_length, effect)
    pairs: List[Tuple[str, str]] = []
    if rate is not None:
        if rate == 0.0:
            model = '{ kind = "none" }'
        elif burst is None or burst == 1.0:
            model = f'{{ kind = "uniform", rate = {_short(rate)} }}'
        else:
            model = f'{{ kind = "gilbert_elliott", rate = {_short(rate)}, mean_burst = {_short(burst)} }}'
        pairs.append(("model", model))
    if name is not None:
        pairs.append(("effect", name))
    return pairs


def check_config_keys(config: Mapping[str, Any], allowed: Tuple[str, ...], what: str) -> None:
    """Refuses a key of ``config`` that is not in ``allowed`` (a typo), naming both."""
    for key in config:
        if key not in allowed:
            raise LossyConfigError(
                f"{what}: unknown key {echo(key)} (value {echo(config[key])}); allowed: {', '.join(allowed)}"
            )
