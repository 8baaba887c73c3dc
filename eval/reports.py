"""A benchmark's or an evaluation's report: the JSON file (when a path was given) and the
plain-text table."""
from __future__ import annotations

import json


def write_json(path: str | None, report: dict) -> None:
    """Write `report` to `path` as indented JSON; nothing when path is None or empty."""
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


def format_columns(rows: list[dict], columns: list[tuple[str, str, object]]) -> str:
    """A plain-text table: one line per row, under a header and a rule. columns: (title, align
    and width as in a format spec, e.g. "<16" or ">10", a function row -> the cell's text)."""
    head = " ".join(f"{title:{spec}}" for title, spec, _ in columns)
    lines = [head, "-" * len(head)]
    lines += [" ".join(f"{cell(r):{spec}}" for _, spec, cell in columns) for r in rows]
    return "\n".join(lines)

