"""`parse_stage_spec` and `build_stage`: from configuration text to a `Stage`."""

from __future__ import annotations

import difflib
from typing import Any

from joader.errors import InvalidArgumentError
from joader.stages.base import Stage
from joader.stages.image import (
    DECODERS,
    DEFAULT_DECODER,
    IMAGE_KINDS,
    MODES,
    TURBO_OPTIONS,
    ImageStage,
)
from joader.stages.user import USER_STAGE_RE, load_user_stage

__all__ = ["build_stage", "parse_stage_spec"]

_FORMS = (
    "center-crop[:SIZE], resize[:SIZE], max-side[:SIZE], or a user stage "
    "'package.module:factory'"
)


def parse_stage_spec(text: str) -> tuple[str, int | None]:
    """"resize:256" -> ("resize", 256); "center-crop" -> ("center-crop", None);
    "pkg.mod:factory" -> ("pkg.mod:factory", None). InvalidArgumentError names the fix."""
    if not isinstance(text, str):
        raise InvalidArgumentError(f"stage must be text such as 'center-crop:256', got {text!r}")
    spec = text.strip()
    head, sep, tail = spec.partition(":")
    if head in IMAGE_KINDS:
        if not sep:
            return head, None
        if "/" in tail:
            raise InvalidArgumentError(
                f"stage {text!r}: only the kind and size go here ({head}:SIZE); the mode (RGB, "
                "L) and the decoder (pil, pil-draft, turbo) are separate settings"
            )
        try:
            size = int(tail, 10)
        except ValueError:
            size = 0
        if size <= 0 or not tail.isdigit():
            raise InvalidArgumentError(
                f"stage {text!r}: the size after '{head}:' must be a positive integer number "
                f"of pixels, e.g. '{head}:256'"
            )
        return head, size
    if USER_STAGE_RE.match(spec):
        return spec, None
    hint = ""
    close = difflib.get_close_matches(head.lower(), IMAGE_KINDS, n=1, cutoff=0.6)
    if close:
        hint = f" (did you mean '{close[0]}{sep}{tail}'?)"
    elif sep and not tail:
        hint = " (a user stage needs the factory's name after the colon)"
    raise InvalidArgumentError(f"stage {text!r} is not one of {_FORMS}{hint}")


def build_stage(
    kind: str,
    *,
    size: int,
    mode: str = "RGB",
    upscale: bool = True,
    decoder: str = DEFAULT_DECODER,
    exif_transpose: bool = False,
    options: dict[str, Any] | None = None,
) -> Stage:
    """The stage `kind` ("center-crop", "resize", "max-side", or "package.module:factory").

    size: S in pixels (built-in kinds). mode: "RGB" (C=3) or "L" (C=1). upscale: images smaller
    than S are enlarged to S as torchvision's Resize does (the default; False: kept at their
    size, see `joader.stages`; max-side never enlarges). decoder: "pil" (exactly torchvision's),
    "pil-draft" (Pillow with JPEG DCT scaling) or "turbo" (simplejpeg + OpenCV). exif_transpose:
    turn each image upright by its EXIF orientation first (`ImageOps.exif_transpose`).
    options: a user stage's factory argument; for decoder "turbo", {"fastdct": bool,
    "fastupsample": bool}.
    """
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise InvalidArgumentError(
            f"stage options must be a dict (a TOML table), got {type(options).__name__}"
        )
    if not isinstance(kind, str):
        raise InvalidArgumentError(f"stage kind must be text, got {kind!r}")
    if kind not in IMAGE_KINDS:
        if USER_STAGE_RE.match(kind):
            return load_user_stage(kind, options)
        name = kind.partition(":")[0]
        if name in IMAGE_KINDS:
            raise InvalidArgumentError(
                f"stage kind {kind!r}: pass the kind alone ({name!r}) and the size as size=; "
                "parse_stage_spec splits 'kind:SIZE'"
            )
        parse_stage_spec(kind)  # raises with the forms and a suggestion
        raise InvalidArgumentError(f"stage kind {kind!r} is not one of {_FORMS}")
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise InvalidArgumentError(
            f"stage {kind}: size must be a positive integer number of pixels, got {size!r}"
        )
    if mode not in MODES:
        raise InvalidArgumentError(
            f"stage {kind}: mode must be 'RGB' (3 channels) or 'L' (1 channel, grey), got "
            f"{mode!r}"
        )
    if decoder not in DECODERS:
        raise InvalidArgumentError(
            f"stage {kind}: decoder must be 'pil' (exactly torchvision's), 'pil-draft' (Pillow "
            f"with JPEG DCT scaling, faster) or 'turbo' (simplejpeg + OpenCV, fastest), got "
            f"{decoder!r}"
        )
    for key, flag in (("upscale", upscale), ("exif_transpose", exif_transpose)):
        if not isinstance(flag, bool):
            raise InvalidArgumentError(f"stage {kind}: {key} must be true or false, got {flag!r}")
    allowed = TURBO_OPTIONS if decoder == "turbo" else {}
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        where = (
            f"decoder turbo takes only {sorted(allowed)}"
            if allowed
            else f"built-in stages with decoder {decoder} take no options"
        )
        raise InvalidArgumentError(
            f"stage {kind}: unknown option(s) {unknown}; {where}; remove them"
        )
    for key, value in options.items():
        if not isinstance(value, bool):
            raise InvalidArgumentError(
                f"stage {kind}: option {key} must be true or false, got {value!r}"
            )
    flags = {**TURBO_OPTIONS, **options}
    return ImageStage(kind, size, mode, upscale, decoder, exif_transpose=exif_transpose, **flags)
