"""Stages: the shared, deterministic preparation of an item, done once in joaderd for every job.

    from joader.stages import ItemSpec, Stage, build_stage, parse_stage_spec

    kind, size = parse_stage_spec("center-crop:256")          # ("center-crop", 256)
    stage = build_stage(kind, size=size, mode="RGB", decoder="pil")
    stage.name        # "center-crop:256/pil"
    stage.spec        # ItemSpec(shape=(3, 256, 256), dtype="uint8", ndim=3, max_nbytes=196608)
    stage.prepare(data, "train/n01440764/x.JPEG")             # uint8 (3, 256, 256), C-contiguous

Built-in kinds (uint8 CHW, C = 3 for mode "RGB", 1 for "L"; any Pillow mode is converted):
- "center-crop": torchvision's Resize(S) + CenterCrop(S), (C, S, S), a fixed spec: every image,
  small or of any aspect ratio, comes out S x S (upscale, the default). With upscale False an
  image whose shorter side is below S is not enlarged: the output is its largest centered square
  (side min(w, h) < S), so the spec is variable (max C*S*S bytes).
- "resize": the shorter side to S, aspect kept (torchvision's Resize(S)); the longer side capped
  at 8*S (the shorter then scaled down alike) to bound the bytes; upscale False keeps a small
  image's size. Variable, at most C * S * 8S bytes.
- "max-side": the longer side capped at S, aspect kept, never enlarged (upscale does not apply).
  Variable, max C*S*S.
exif_transpose=True turns each image upright by its EXIF orientation first (off by default, as
in torchvision's ImageFolder).

Decoders: "pil" is exactly torchvision's decode + Resize + CenterCrop, bit for bit (Pillow; bounded
work for extreme shapes); "pil-draft" adds `Image.draft` for large JPEGs (DCT scaling: faster,
not bit-exact); "turbo" (the default) decodes JPEGs with simplejpeg (libjpeg-turbo, scaled DCT;
options fastdct, fastupsample) and resizes with OpenCV, within about a grey level of "pil" on
average, about twice as fast on ImageNet-sized JPEGs (`bench/micro/stage.py`, `bench/micro/decoders.py`,
docs/decoders.md). Non-JPEG files are decoded by Pillow under all three.

User stages: "package.module:factory", factory(options) -> an object with prepare(data, path)
and an optional `spec` (see `joader.stages.user`).

Every failure on an item's data raises `joader.errors.DecodeError` naming the item; every bad
stage description raises `joader.errors.InvalidArgumentError` naming the fix.
"""

from joader.stages.base import ANY_DTYPE, ANY_NDIM, ItemSpec, Stage
from joader.stages.build import build_stage, parse_stage_spec
from joader.stages.image import DECODERS, DEFAULT_DECODER, IMAGE_KINDS, MODES, ImageStage
from joader.stages.user import DEFAULT_MAX_ITEM_BYTES, UserStage

__all__ = [
    "ANY_DTYPE",
    "ANY_NDIM",
    "DECODERS",
    "DEFAULT_DECODER",
    "DEFAULT_MAX_ITEM_BYTES",
    "IMAGE_KINDS",
    "MODES",
    "ImageStage",
    "ItemSpec",
    "Stage",
    "UserStage",
    "build_stage",
    "parse_stage_spec",
]
