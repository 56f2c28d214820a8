"""Stage descriptions: parse_stage_spec, build_stage's checks, ItemSpec, user stages."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from joader.errors import DecodeError, InvalidArgumentError
from joader.stages import (
    DEFAULT_MAX_ITEM_BYTES,
    ItemSpec,
    Stage,
    UserStage,
    build_stage,
    parse_stage_spec,
)

pytestmark = pytest.mark.timeout(60)

SUPPORT = Path(__file__).resolve().parents[2] / "support"


@pytest.fixture(autouse=True)
def _importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(SUPPORT))  # userstage_example lives in tests/support


def _png(width: int = 40, height: int = 30) -> bytes:
    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


# -- parse_stage_spec --------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "want"), [
    ("center-crop:256", ("center-crop", 256)),
    ("center-crop", ("center-crop", None)),
    (" resize:224 ", ("resize", 224)),
    ("max-side:512", ("max-side", 512)),
    ("pkg.mod:factory", ("pkg.mod:factory", None)),
    ("mod:Cls.build", ("mod:Cls.build", None)),
])  # fmt: skip
def test_parse_good(text: str, want: tuple[str, int | None]) -> None:
    assert parse_stage_spec(text) == want


@pytest.mark.parametrize(("text", "fix"), [
    ("resize:0", "positive integer"),
    ("resize:-3", "positive integer"),
    ("resize:abc", "positive integer"),
    ("resize:", "positive integer"),
    ("center-crop:256:1", "positive integer"),
    ("resize:256/L/turbo", "separate settings"),
    ("centre-crop:256", "did you mean 'center-crop:256'"),
    ("maxside", "did you mean 'max-side'"),
    ("pkg.mod:", "factory's name after the colon"),
    (":factory", "package.module:factory"),
    ("pkg-x:factory", "package.module:factory"),
    ("", "center-crop[:SIZE]"),
])  # fmt: skip
def test_parse_bad(text: str, fix: str) -> None:
    with pytest.raises(InvalidArgumentError, match=fix.replace("[", r"\[").replace("]", r"\]")):
        parse_stage_spec(text)


# -- build_stage checks ------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "fix"), [
    ({"kind": "center-crop", "size": 0}, "size must be a positive integer"),
    ({"kind": "center-crop", "size": 25.5}, "size must be a positive integer"),
    ({"kind": "center-crop", "size": True}, "size must be a positive integer"),
    ({"kind": "resize", "size": 64, "mode": "RGBA"}, "mode must be 'RGB'"),
    ({"kind": "resize", "size": 64, "decoder": "cv2"}, "decoder must be 'pil'"),
    ({"kind": "resize", "size": 64, "upscale": "yes"}, "upscale must be true or false"),
    ({"kind": "resize", "size": 64, "exif_transpose": 1}, "exif_transpose must be true or false"),
    ({"kind": "resize", "size": 64, "decoder": "pillow"}, "'pil-draft' .* or 'turbo'"),
    ({"kind": "resize", "size": 64, "decoder": "pil-draft", "options": {"fastdct": True}},
     "decoder pil-draft take no options"),
    ({"kind": "resize:64", "size": 64}, "pass the kind alone"),
    ({"kind": "crop", "size": 64}, "is not one of"),
    ({"kind": "resize", "size": 64, "decoder": "pil", "options": {"fastdct": True}}, "take no options"),
    ({"kind": "resize", "size": 64, "decoder": "turbo", "options": {"fast": 1}},
     r"decoder turbo takes only \['fastdct', 'fastupsample'\]"),
    ({"kind": "resize", "size": 64, "decoder": "turbo", "options": {"fastdct": 1}},
     "must be true or false"),
    ({"kind": "resize", "size": 64, "options": [1]}, "must be a dict"),
])  # fmt: skip
def test_build_bad(kwargs: dict, fix: str) -> None:
    kind = kwargs.pop("kind")
    with pytest.raises(InvalidArgumentError, match=fix):
        build_stage(kind, **kwargs)


# -- ItemSpec ----------------------------------------------------------------------------------


def test_item_spec() -> None:
    spec = ItemSpec.fixed((3, 4, 5), "f4")
    assert spec == ItemSpec((3, 4, 5), "float32", 3, 240) and spec.is_fixed
    assert ItemSpec([2, 2], "uint8", 2, 4).shape == (2, 2)  # normalised to a tuple
    assert spec.check(np.zeros((3, 4, 5), np.float32)) is None
    assert "shape" in spec.check(np.zeros((3, 4, 6), np.float32))
    assert "dtype" in spec.check(np.zeros((3, 4, 5), np.float64))
    var = ItemSpec.variable(100)
    assert var.shape is None and var.dtype == "" and var.ndim == -1 and not var.is_fixed
    assert var.check(np.zeros(10, np.float64)) is None
    assert "max_nbytes" in var.check(np.zeros(13, np.float64))
    assert "dimensions" in ItemSpec.variable(100, "uint8", 3).check(np.zeros((2, 2), np.uint8))


@pytest.mark.parametrize(("kwargs", "fix"), [
    ({"shape": (2, 2), "dtype": "uint8", "ndim": 2, "max_nbytes": 5}, "exactly 4"),
    ({"shape": (2, 2), "dtype": "uint8", "ndim": 3, "max_nbytes": 4}, "2 dimensions"),
    ({"shape": (2, -1), "dtype": "uint8", "ndim": 2, "max_nbytes": 4}, "non-negative"),
    ({"shape": None, "dtype": "pixels", "ndim": 2, "max_nbytes": 4}, "not a numpy dtype"),
    ({"shape": None, "dtype": "object", "ndim": 2, "max_nbytes": 4}, "plain number"),
    ({"shape": None, "dtype": "uint8", "ndim": 2, "max_nbytes": 0}, "positive int"),
    ({"shape": (2,), "dtype": "", "ndim": 1, "max_nbytes": 2}, "needs a dtype"),
])  # fmt: skip
def test_item_spec_bad(kwargs: dict, fix: str) -> None:
    with pytest.raises(InvalidArgumentError, match=fix):
        ItemSpec(**kwargs)


# -- user stages -------------------------------------------------------------------------------


def test_user_stage_returning_float32() -> None:
    stage = build_stage("userstage_example:factory", size=999, options={"size": 24})
    assert isinstance(stage, UserStage) and isinstance(stage, Stage)
    assert stage.name == "userstage_example:factory"
    assert stage.spec == ItemSpec.fixed((1, 24, 24), "float32")
    out = stage.prepare(_png(), "a/b.png")
    assert out.shape == (1, 24, 24) and out.dtype == np.float32 and out.flags.c_contiguous
    assert 0.0 <= out.min() and out.max() <= 1.0


def test_user_stage_without_spec_is_variable() -> None:
    stage = build_stage("userstage_example:factory", size=1, options={"variable": True})
    assert stage.spec == ItemSpec(None, "", -1, DEFAULT_MAX_ITEM_BYTES)
    assert stage.prepare(_png(40, 30), "x").shape == (1, 24, 32)
    small = build_stage(
        "userstage_example:factory", size=1, options={"variable": True, "max_item_bytes": 1000}
    )
    assert small.spec.max_nbytes == 1000
    with pytest.raises(DecodeError, match="more than the spec's max_nbytes 1000"):
        small.prepare(_png(), "x")


def test_user_stage_item_checks() -> None:
    native = build_stage("userstage_example:factory", size=1, options={"big_endian": True})
    out = native.prepare(_png(), "x")
    assert out.dtype == np.dtype("float32") and out.dtype.isnative
    failing = build_stage("userstage_example:factory", size=1, options={"fail_on": "bad"})
    with pytest.raises(DecodeError, match=r"failed on dir/bad\.png: ValueError: refusing"):
        failing.prepare(_png(), "dir/bad.png")
    wrong = build_stage("userstage_example:factory", size=1, options={"bad_shape": True})
    with pytest.raises(DecodeError, match=r"shape \(1, 33, 32\), but the stage's spec says"):
        wrong.prepare(_png(), "x.png")


@pytest.mark.parametrize(("kind", "options", "fix"), [
    ("no_such_module_xyz:factory", {}, "no module named 'no_such_module_xyz'.*PYTHONPATH"),
    ("userstage_example:nope", {}, "has no 'nope'; check the name after the colon"),
    ("userstage_example:NOT_CALLABLE", {}, "not a callable"),
    ("userstage_example:broken_factory", {}, "raised RuntimeError: the model file is missing"),
    ("userstage_example:no_prepare", {}, "has no prepare\\(\\) method"),
    ("userstage_example:bad_spec", {}, "not a joader.stages.ItemSpec"),
    ("userstage_example:factory", {"variable": True, "max_item_bytes": "1G"},
     "max_item_bytes must be a positive integer"),
])  # fmt: skip
def test_user_stage_bad(kind: str, options: dict, fix: str) -> None:
    with pytest.raises(InvalidArgumentError, match=fix):
        build_stage(kind, size=1, options=options)
