"""Write docs/FEATURES.md from the feature registry (name, family, definition, warm-up, TA-Lib reference)."""

from __future__ import annotations

import argparse
from pathlib import Path

from foxhunt.features.docs import features_markdown

DEFAULT = Path(__file__).resolve().parents[1] / "docs" / "FEATURES.md"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=DEFAULT, help="where to write the markdown")
    ap.add_argument("--check", action="store_true", help="exit 1 if the file differs from the registry instead of writing")
    args = ap.parse_args()
    text = features_markdown()
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            raise SystemExit(f"{args.out} is out of date: run python scripts/gen_features_doc.py")
        print(f"{args.out} is up to date")
        return
    args.out.write_text(text)
    print(f"wrote {args.out} ({text.count(chr(10))} lines)")


if __name__ == "__main__":
    main()
