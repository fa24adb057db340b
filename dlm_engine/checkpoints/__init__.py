"""Checkpoints shipped inside the package (see ``tiny/README.md`` for the embedded model's card)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent


def embedded_path(name: str = "tiny") -> Optional[str]:
    """Directory of a shipped checkpoint, or None if it is not present."""
    p = HERE / name
    return str(p) if (p / "config.json").is_file() else None
