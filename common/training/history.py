"""A fold's history.csv: one row per epoch, as Keras' CSVLogger writes it, kept whole across a resume."""

from __future__ import annotations

import csv
from pathlib import Path


class History:
    """history.csv, one row per epoch (epoch, then the logs' keys sorted, as Keras' CSVLogger writes it). A resumed
    fold drops rows of epochs its checkpoint does not hold, so every epoch appears once."""

    def __init__(self, path: Path, initial_epoch: int):
        self.path = Path(path)
        rows = []
        if initial_epoch and self.path.is_file():
            with self.path.open(newline="") as f:
                rows = [r for r in csv.DictReader(f) if int(r["epoch"]) < initial_epoch]
        self.header = list(rows[0]) if rows else None
        with self.path.open("w", newline="") as f:
            if rows:
                writer = csv.DictWriter(f, fieldnames=self.header)
                writer.writeheader()
                writer.writerows(rows)

    def append(self, epoch: int, logs: dict) -> None:
        row = {"epoch": epoch, **{k: logs[k] for k in sorted(logs)}}
        first = self.header is None
        self.header = self.header or list(row)
        with self.path.open("a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.header, extrasaction="ignore")
            if first:
                writer.writeheader()
            writer.writerow(row)
