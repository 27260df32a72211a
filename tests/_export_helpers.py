"""What the export tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

import foxhunt
from foxhunt.export.metadata import ExportError


def refusal(root: Path) -> str:
    """The one-line ExportError that loading ``root`` raises."""
    with pytest.raises(ExportError) as info:
        foxhunt.load(root)
    message = str(info.value)
    assert "\n" not in message, message
    return message
