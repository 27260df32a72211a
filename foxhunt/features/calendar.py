"""Calendar: time of day, day of week and time of year as sin/cos, from UTC timestamps; known in advance."""

from __future__ import annotations

import numpy as np

from foxhunt.features.registry import FeatureList

_NS_PER_S = 1_000_000_000
_DAY_S = 86_400
_YEAR_DAYS = 365.2425
_TWO_PI = 2.0 * np.pi
DAYS_PER_NS = 1.0 / (_NS_PER_S * _DAY_S)


def _phases(ts_ns: np.ndarray) -> dict[str, np.ndarray]:
    """Phases in [0, 1) of the day, week and year; float64 seconds are exact to well under a second."""
    return phases_of_days(np.asarray(ts_ns, dtype=np.int64) * DAYS_PER_NS)


def phases_of_days(days):  # numpy array or torch tensor (float64 days since the epoch): both backends share it
    """Phases in [0, 1) of the day, week and year from fractional days since the epoch."""
    whole = days // 1.0
    tod = days - whole
    weeks = (whole + 3.0) / 7.0  # 1970-01-01 was a Thursday; Monday = 0
    dow = weeks - weeks // 1.0
    years = days / _YEAR_DAYS
    toy = years - years // 1.0
    return {"tod": tod, "dow": dow, "toy": toy}


CALENDAR_DEFINITIONS = {
    "tod_sin": ("sin(2 pi (UTC seconds since midnight) / 86400)", "tod", np.sin),
    "tod_cos": ("cos(2 pi (UTC seconds since midnight) / 86400)", "tod", np.cos),
    "dow_sin": ("sin(2 pi weekday / 7), Monday = 0 (UTC)", "dow", np.sin),
    "dow_cos": ("cos(2 pi weekday / 7), Monday = 0 (UTC)", "dow", np.cos),
    "toy_sin": ("sin(2 pi (days since epoch mod 365.2425) / 365.2425)", "toy", np.sin),
    "toy_cos": ("cos(2 pi (days since epoch mod 365.2425) / 365.2425)", "toy", np.cos),
}


def calendar_array(ts_ns: np.ndarray, names: list[str], phases: dict | None = None) -> np.ndarray:
    """[len(names), *ts.shape] calendar features of int64 ns UTC timestamps (trigonometry in float32)."""
    ph = _phases(ts_ns) if phases is None else phases
    out = np.empty((len(names),) + np.shape(ts_ns), dtype=np.float32)
    for i, n in enumerate(names):
        _, key, fn = CALENDAR_DEFINITIONS[n]
        out[i] = fn((_TWO_PI * ph[key]).astype(np.float32))
    return out


def features() -> FeatureList:
    fl = FeatureList("calendar")
    for name, (definition, _, _) in CALENDAR_DEFINITIONS.items():
        fl.add(name, definition, 0, lambda p, out=None, name=name: calendar_array(p.timestamps, [name], p.memo("calendar_phases", lambda: _phases(p.timestamps)))[0], known_future=True)
    return fl
