"""Sources: listing an ImageFolder tree, the shared stage (decode, resize, crop), demo data."""

from joader.sources.imagefolder import SourceListing, full_path, list_image_folder
from joader.sources.stage import item_nbytes, prepare, prepare_into

__all__ = [
    "SourceListing",
    "full_path",
    "item_nbytes",
    "list_image_folder",
    "prepare",
    "prepare_into",
]
