"""The local data files a recipe's `data.dataset` may name: the formats the trainer loads them as, and their column
names read from the first record alone (no `datasets`), so a recipe is checked on a login node in milliseconds.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}  # suffix: datasets' builder


def local_columns(path: Path) -> list[str]:
    """The column names of a local data file, read from its first record (or header, or schema) only."""
    if path.suffix == ".parquet":
        import pyarrow.parquet

        return list(pyarrow.parquet.read_schema(path).names)
    with open(path, newline="", encoding="utf-8") as file:
        if path.suffix == ".csv":
            return next(csv.reader(file), [])
        if path.suffix == ".jsonl":
            first = next((line for line in file if line.strip()), "{}")
            record = json.loads(first)
        else:
            data = json.load(file)
            record = data[0] if isinstance(data, list) and data else data
    if not isinstance(record, dict):
        raise ValueError(f"a record is {type(record).__name__}, not an object with columns")
    return list(record)
