"""Opening items inside the source root only, with the real reason when a file cannot be read."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from joader.errors import DecodeError
from joader.sources.base import read_in_root
from joader.sources.safe_open import display_path, open_in_root
from joader.stages import build_stage

STAGE = build_stage("center-crop", size=16, upscale=True, decoder="pil")


def prepare_in_root(root: Path, relative: str) -> np.ndarray:
    """What a decode worker does: read inside the root only, then the stage."""
    return STAGE.prepare(read_in_root(root, relative), relative)

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    Image.new("RGB", (40, 30), (10, 20, 30)).save(root / "a" / "ok.png")
    return root


def test_a_file_inside_the_root_opens(root: Path) -> None:
    fd = open_in_root(str(root), "a/ok.png")
    os.close(fd)
    out = prepare_in_root(root, "a/ok.png")
    assert np.array_equal(out, STAGE.prepare((root / "a" / "ok.png").read_bytes(), "a/ok.png"))


def test_a_symlink_swapped_in_later_is_refused(root: Path, tmp_path: Path) -> None:
    outside = tmp_path / "secret.png"
    Image.new("RGB", (40, 30)).save(outside)
    (root / "a" / "ok.png").unlink()
    (root / "a" / "ok.png").symlink_to(outside)
    with pytest.raises(DecodeError, match="outside the source root"):
        open_in_root(str(root), "a/ok.png")


def test_a_symlink_inside_the_root_is_followed(root: Path) -> None:
    (root / "a" / "link.png").symlink_to(root / "a" / "ok.png")
    os.close(open_in_root(str(root), "a/link.png"))


def test_a_fifo_does_not_hang_the_reader(root: Path) -> None:
    os.mkfifo(root / "a" / "stuck.jpg")
    result: list[BaseException] = []

    def attempt() -> None:
        try:
            open_in_root(str(root), "a/stuck.jpg")
        except BaseException as error:  # noqa: BLE001
            result.append(error)

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(5)
    assert not thread.is_alive(), "opening a FIFO blocked"
    assert isinstance(result[0], DecodeError) and "regular file" in str(result[0])


def test_a_removed_file_is_not_called_corrupt(root: Path) -> None:
    (root / "a" / "ok.png").unlink()
    with pytest.raises(DecodeError, match="no longer exists|removed") as caught:
        prepare_in_root(root, "a/ok.png")
    assert "corrupt" not in str(caught.value)


def test_permission_denied_is_named(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Tests run as root here, which reads any file: make the open itself fail as it would.
    def refuse(*_args: object, **_kwargs: object) -> int:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(DecodeError, match="[Pp]ermission") as caught:
        open_in_root(str(root), "a/ok.png")
    assert "corrupt" not in str(caught.value)


def test_non_utf8_names_open_and_their_errors_are_encodable(root: Path) -> None:
    name = os.fsdecode(b"bad\xfe.png")
    (root / "a" / name).write_bytes(b"not an image")
    with pytest.raises(DecodeError) as caught:
        prepare_in_root(root, f"a/{name}")
    message = str(caught.value)
    message.encode("utf-8")  # no lone surrogates left
    assert "bad\\xfe.png" in message
    assert display_path(name) == "bad\\xfe.png"


@pytest.mark.parametrize("shape", [(1, 10000), (10000, 1), (3, 4000)])
def test_thin_images_give_the_center_crop_with_bounded_work(tmp_path: Path, shape: tuple[int, int]) -> None:
    path = tmp_path / "thin.png"
    width, height = shape
    gradient = np.linspace(0, 255, max(width, height), dtype=np.uint8)
    pixels = np.broadcast_to(gradient.reshape((height, 1) if height > width else (1, width)), (height, width))
    Image.fromarray(np.ascontiguousarray(pixels)).convert("RGB").save(path)
    out = build_stage("center-crop", size=64, upscale=True).prepare(path.read_bytes(), "thin.png")
    assert out.shape == (3, 64, 64)
    # The crop is the middle of the long side: the gradient's middle values, not its ends.
    assert 100 < int(out.mean()) < 156
