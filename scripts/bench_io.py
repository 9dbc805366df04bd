"""What every benchmark script does with its figures: print them and write them as JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable


def write_result(path: str | Path, result: dict[str, Any], hide: Iterable[str] = (), show: bool = True) -> None:
    """Print ``result`` (unless ``show`` is False; less the bulky keys in ``hide``) and write all of it
    to ``path`` as JSON."""
    hidden = set(hide)
    if show:
        print(json.dumps({k: v for k, v in result.items() if k not in hidden}, indent=1))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
