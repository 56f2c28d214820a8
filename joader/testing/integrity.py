"""Content checks for fault tests: every delivered sample against a decode made outside joaderd.

A count can be right while the content is wrong (after a restart, readers once copied the rest
of an epoch out of the old arena: right labels, other items' pixels, every count still exact).
So a fault test records, for every sample a job receives, its epoch, index, label and the crc32
of its pixels (`integrity_job`, run as its own process), and `check_records` compares each one
with `reference`: the same stage run here, in the test process, on the file's bytes.

The pytest process imports only `reference` and `check_records` (no gRPC, no torch DataLoader).
"""

from __future__ import annotations

import json
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from joader.sources.base import open_source
from joader.stages import build_stage


@dataclass(frozen=True)
class Expected:
    label: int
    crc: int


def reference(root: Path, image_size: int, stage: str = "center-crop", decoder: str = "turbo") -> dict[int, Expected]:
    """index -> (label, crc32 of the prepared pixels), decoded here, not by joaderd."""
    listing = open_source(str(root))
    prepare = build_stage(stage, size=image_size, decoder=decoder)
    expected = {}
    for index, path in enumerate(listing.paths):
        array = prepare.prepare(listing.read(index), str(path))
        expected[index] = Expected(int(listing.labels[index]), zlib.crc32(array.tobytes()))
    return expected


@dataclass
class Findings:
    """What `check_records` found; `problems` names the first few of each kind."""

    checked: int = 0
    wrong_pixels: int = 0
    wrong_labels: int = 0
    duplicated: int = 0
    missing: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.wrong_pixels or self.wrong_labels or self.duplicated or self.missing)

    def note(self, text: str) -> None:
        if len(self.problems) < 12:
            self.problems.append(text)

    def summary(self) -> str:
        return (f"checked {self.checked}, wrong pixels {self.wrong_pixels}, wrong labels "
                f"{self.wrong_labels}, duplicated {self.duplicated}, missing {self.missing}"
                + "".join(f"\n  {p}" for p in self.problems))


def read_records(path: Path) -> list[dict[str, Any]]:
    """The job's records, one JSON object per line (a killed job may leave a torn last line)."""
    records: list[dict[str, Any]] = []
    if not path.exists():
        return records
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def check_records(records: list[dict[str, Any]], expected: dict[int, Expected], subset: set[int],
                  epochs: int, name: str, findings: Findings | None = None) -> Findings:
    """Every sample's pixels and label, and each of the first `epochs` epochs exactly once over
    `subset`; any later epoch the records hold (a job that ended or failed mid-epoch) at most
    once, within `subset`."""
    findings = findings or Findings()
    by_epoch: dict[int, Counter[int]] = {}
    for record in records:
        if record.get("kind") != "sample":
            continue
        epoch, index = record["epoch"], record["index"]
        findings.checked += 1
        want = expected.get(index)
        if want is None or want.crc != record["crc"]:
            findings.wrong_pixels += 1
            findings.note(f"{name} epoch {epoch}: item {index} has other pixels (crc {record['crc']:#x}, "
                          f"expected {want.crc if want else None:#x})" if want else f"{name}: unknown item {index}")
        if want is not None and want.label != record["label"]:
            findings.wrong_labels += 1
            findings.note(f"{name} epoch {epoch}: item {index} labelled {record['label']}, expected {want.label}")
        by_epoch.setdefault(epoch, Counter())[index] += 1
    for epoch in range(1, epochs + 1):
        seen = by_epoch.get(epoch, Counter())
        twice = sorted(i for i, c in seen.items() if c > 1)
        missing = sorted(subset - set(seen))
        extra = sorted(set(seen) - subset)
        findings.duplicated += sum(seen[i] - 1 for i in twice) + len(extra)
        findings.missing += len(missing)
        if twice or missing or extra:
            findings.note(f"{name} epoch {epoch}: {len(seen)} distinct of {len(subset)}; twice {twice[:8]}, "
                          f"missing {missing[:8]}, not in its subset {extra[:8]}")
    for epoch in sorted(e for e in by_epoch if e > epochs):  # partial: nothing twice, nothing foreign
        seen = by_epoch[epoch]
        twice = sorted(i for i, c in seen.items() if c > 1)
        extra = sorted(set(seen) - subset)
        findings.duplicated += sum(seen[i] - 1 for i in twice) + len(extra)
        if twice or extra:
            findings.note(f"{name} epoch {epoch} (partial): twice {twice[:8]}, not in its subset {extra[:8]}")
    return findings


def complete_epochs(records: list[dict[str, Any]]) -> int:
    """How many epochs the job's records mark as finished (`integrity_job` writes a line of kind
    "epoch" after each; a checkpoint's truncation keeps only those before it)."""
    return sum(1 for record in records if record.get("kind") == "epoch")
