"""Test data helpers: a JPEG broken at decode, and an ImageFolder written as the other sources.

`write_list_file` and `write_tar_shards` write the items of an ImageFolder as a list file or as
WebDataset tar shards, in the listing's order: item `i` is the same image bytes and label in all
three kinds of source (`joader.sources.open_source`). The ImageFolder is usually demo data
(`joader.client.tools.demo_data.make_demo_data`).
"""

from __future__ import annotations

import csv
import io
import os
import tarfile
from pathlib import Path

from joader.errors import InvalidArgumentError
from joader.sources.imagefolder import list_image_folder

__all__ = ["corrupt_jpeg", "write_list_file", "write_tar_shards"]


def corrupt_jpeg(path: str | os.PathLike[str]) -> None:
    """Truncate a file to about a third of its size: it still opens but fails at decode."""
    size = os.path.getsize(path)
    os.truncate(path, max(size // 3, 1))


def write_list_file(
    listing_root: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    sep: str = "\t",
    labels: str = "int",
    *,
    header: bool = True,
) -> Path:
    """Write the ImageFolder at `listing_root` as a list file; return its path.

    One `relative/path<sep>label` line per item, in the listing's order (item ids are equal),
    paths relative to `out_path`'s folder, which must be `listing_root` or a folder above it.
    `sep` is "\t" (for a .tsv) or "," (for a .csv, quoted as the csv module does); `labels`
    is "int" (the ImageFolder label) or "name" (the class folder's name; the ids are then equal
    to the ImageFolder's when every class folder holds images, as class names sort the same).
    With `header`, the first line is `path<sep>label`.
    """
    if sep not in ("\t", ","):
        raise InvalidArgumentError(f"sep must be a tab or a comma, got {sep!r}")
    if labels not in ("int", "name"):
        raise InvalidArgumentError(f"labels must be 'int' or 'name', got {labels!r}")
    out = Path(out_path).expanduser().absolute()
    wanted_suffix = ".tsv" if sep == "\t" else ".csv"
    if out.suffix.lower() != wanted_suffix:
        raise InvalidArgumentError(
            f"a list file separated by {'tabs' if sep == chr(9) else 'commas'} must be named "
            f"*{wanted_suffix}, got {out.name}; rename it"
        )
    listing = list_image_folder(listing_root)
    out_dir = out.parent.resolve()
    prefix = os.path.relpath(listing.root, out_dir)
    if prefix == ".." or prefix.startswith("../"):
        raise InvalidArgumentError(
            f"list file {out} would need paths leaving its folder to reach {listing.root}; "
            "write it into the image folder or a folder above it"
        )
    rows = (
        (
            p if prefix == "." else f"{prefix}/{p}",
            str(label) if labels == "int" else listing.classes[label],
        )
        for p, label in zip(listing.paths, listing.labels.tolist(), strict=True)
    )
    tmp = out.with_name(f".{out.name}.tmp")
    with open(tmp, "w", encoding="utf-8", errors="surrogateescape", newline="") as file:
        if sep == ",":
            writer = csv.writer(file, lineterminator="\n")
            if header:
                writer.writerow(("path", "label"))
            writer.writerows(rows)
        else:
            if header:
                file.write("path\tlabel\n")
            for rel, text in rows:
                if any(c in rel or c in text for c in "\t\n\r"):
                    tmp.unlink()
                    raise InvalidArgumentError(
                        f"{rel!r} (label {text!r}) holds a tab or a line break, which a .tsv "
                        "cannot carry; write a .csv (sep=',') instead"
                    )
                file.write(f"{rel}\t{text}\n")
    os.replace(tmp, out)
    return out


def write_tar_shards(
    listing_root: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    items_per_shard: int,
    *,
    labels: str = "int",
) -> list[Path]:
    """Write the ImageFolder at `listing_root` as WebDataset tar shards; return their paths.

    Shards `shard-000000.tar`, ... hold `items_per_shard` samples each, in the listing's order
    (item ids are equal): members `<item id, 9 digits>.<image extension, lower case>` with the
    file's bytes and `<same key>.cls` with the label ("int": the ImageFolder label, "name": the
    class folder's name). `out_dir` is created; it must not hold .tar files already.
    """
    if items_per_shard <= 0:
        raise InvalidArgumentError(f"items_per_shard must be positive, got {items_per_shard}")
    if labels not in ("int", "name"):
        raise InvalidArgumentError(f"labels must be 'int' or 'name', got {labels!r}")
    listing = list_image_folder(listing_root)
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    existing = sorted(p.name for p in out.iterdir() if p.name.lower().endswith(".tar"))
    if existing:
        raise InvalidArgumentError(
            f"{out} already holds .tar files ({existing[0]}, ...); give a new or empty folder"
        )
    shards: list[Path] = []
    for first in range(0, len(listing), items_per_shard):
        shard = out / f"shard-{len(shards):06d}.tar"
        tmp = shard.with_name(f".{shard.name}.tmp")
        with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as archive:
            for item_id in range(first, min(first + items_per_shard, len(listing))):
                key = f"{item_id:09d}"
                ext = os.path.splitext(listing.paths[item_id])[1].lower()
                label = int(listing.labels[item_id])
                text = str(label) if labels == "int" else listing.classes[label]
                _add_member(archive, key + ext, listing.read(item_id))
                _add_member(archive, key + ".cls", text.encode("utf-8", "surrogateescape"))
        os.replace(tmp, shard)
        shards.append(shard)
    return shards


def _add_member(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    info.mtime = 0  # deterministic shards
    archive.addfile(info, io.BytesIO(data))
