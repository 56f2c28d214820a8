"""Sources (ImageFolder trees, list files, tar shards), the shared stage, demo data."""

from joader.sources.base import ItemSource, open_source
from joader.sources.imagefolder import SourceListing, full_path, list_image_folder
from joader.sources.listfile import ListSource, read_list_file
from joader.sources.stage import item_nbytes, prepare, prepare_into
from joader.sources.tarshards import TarSource, index_tar_shards

__all__ = [
    "ItemSource",
    "ListSource",
    "SourceListing",
    "TarSource",
    "full_path",
    "index_tar_shards",
    "item_nbytes",
    "list_image_folder",
    "open_source",
    "prepare",
    "prepare_into",
    "read_list_file",
]
