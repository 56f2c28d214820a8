"""Sources: ImageFolder trees, list files and tar shards behind one `ItemSource`.

The shared stages live in `joader.stages`."""

from joader.sources.base import ItemSource, open_source
from joader.sources.imagefolder import SourceListing, full_path, list_image_folder
from joader.sources.listfile import ListSource, read_list_file
from joader.sources.tarshards import TarSource, index_tar_shards

__all__ = [
    "ItemSource",
    "ListSource",
    "SourceListing",
    "TarSource",
    "full_path",
    "index_tar_shards",
    "list_image_folder",
    "open_source",
    "read_list_file",
]
