"""Write hourly EURUSD (the real series issue 18's reference figures use) as a CSV the agent benchmarks read.

The series is the 5,000 hourly bars (2017-04-19 to 2018-02-07) that the ``backtesting`` package (backtesting.py,
AGPL-3.0) ships as ``backtesting/test/EURUSD.csv``. Nothing of it is kept in this repository: the script downloads that
package's wheel by name (``pip download backtesting==0.6.6 --no-deps``) into a temporary folder, checks the file's
SHA-256, and writes ``timestamp,symbol,open,high,low,close,volume`` (UTC) to the path given:

    python scripts/fetch_eurusd.py eurusd_hourly.csv
    python scripts/ppo_quality.py --phis --seeds 0 1 --real eurusd_hourly.csv --env-steps 131072
"""

from __future__ import annotations

import argparse
import hashlib
import io
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pandas as pd

VERSION = "0.6.6"
MEMBER = "backtesting/test/EURUSD.csv"
SHA256 = "81e977905a006cc8fbc034ebdb83c999a8ed6ba00191dc7ea5ef5b386fb74a82"


def fetch(version: str = VERSION) -> bytes:
    """The bytes of the package's EURUSD.csv, verified against the known SHA-256."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", f"backtesting=={version}", "--no-deps", "-d", tmp]
        subprocess.run(cmd, check=True, capture_output=True)
        wheel = next(Path(tmp).glob("backtesting-*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            raw = zf.read(MEMBER)
    digest = hashlib.sha256(raw).hexdigest()
    if digest != SHA256:
        raise SystemExit(f"{wheel.name}:{MEMBER}: SHA-256 {digest} is not the expected {SHA256}")
    return raw


def to_bars(raw: bytes) -> pd.DataFrame:
    """The package's CSV (index = naive UTC timestamps, capitalised OHLCV columns) as foxhunt's bar columns."""
    df = pd.read_csv(io.BytesIO(raw), index_col=0, parse_dates=True)
    return pd.DataFrame({
        "timestamp": df.index.tz_localize("UTC").strftime("%Y-%m-%dT%H:%M:%SZ"), "symbol": "EURUSD",
        "open": df["Open"].to_numpy(), "high": df["High"].to_numpy(), "low": df["Low"].to_numpy(),
        "close": df["Close"].to_numpy(), "volume": df["Volume"].to_numpy(),
    })


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="the CSV to write")
    args = p.parse_args()
    bars = to_bars(fetch())
    bars.to_csv(args.out, index=False)
    print(f"{args.out}: {len(bars)} hourly bars, {bars['timestamp'].iloc[0]} .. {bars['timestamp'].iloc[-1]}")


if __name__ == "__main__":
    main()
