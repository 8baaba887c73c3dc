"""Writing a benchmark's or an evaluation's report: one JSON file, when a path was given."""
from __future__ import annotations

import json


def write_json(path: str | None, report: dict) -> None:
    """Write `report` to `path` as indented JSON; nothing when path is None or empty."""
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
