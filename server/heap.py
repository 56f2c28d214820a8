"""glibc's heap settings for joaderd's processes (`mallopt`): decode workers that keep their
buffers, and one heap for the main process's threads. Elsewhere than glibc (no `mallopt`),
nothing changes."""

from __future__ import annotations

import ctypes

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
HEAP_MMAP_THRESHOLD = 32 << 20  # allocations below this come from the heap (a 2000x1500 RGB image is 9 MB)
HEAP_TRIM_THRESHOLD = 64 << 20  # free heap kept for the next decode, at most
# joaderd's main process: arrays of 256 KiB and more (an epoch start's arrays of every cached
# item) are mapped and unmapped, and free heap above 1 MiB at its top goes back (`one_arena`)
MAIN_MMAP_THRESHOLD = 256 << 10
MAIN_TRIM_THRESHOLD = 1 << 20


def _mallopt(*settings: tuple[int, int]) -> bool:
    """Sets glibc's malloc parameters; False where there is no `mallopt`."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    for parameter, value in settings:
        mallopt(parameter, value)
    return True


def keep_heap() -> None:
    """Keeps a worker's freed decode buffers in its heap for the next decode.

    A decode allocates a few arrays of hundreds of KB (the decoded image, the filtered and the
    resized one) and frees them all when the task returns. With glibc's default, adaptive
    thresholds the heap's top was then above the trim threshold (twice the largest array freed),
    so it went back to the kernel after every task, and the next decode faulted it in again: 270
    page faults per 500x375 decode, 2.2 ms of CPU per task against 1.6 ms for the same stage in a
    loop that keeps its last arrays alive (`bench/micro/stage.py`). Fixed thresholds (which also turn
    the adaptation off) cut that to about 10 faults and 1.8 ms. The cost: each worker may keep
    up to `HEAP_TRIM_THRESHOLD` of freed memory."""
    _mallopt((_M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, HEAP_TRIM_THRESHOLD))


def one_arena() -> None:
    """The threads created from now on allocate from the main thread's heap, whose thresholds are
    fixed: call before any thread starts.

    NOTE: glibc gives each thread that allocates its own arena (up to 8 per core). joaderd's
    scheduler thread pins a rank's queue in bulk with numpy (`RefCntPolicy.pin_many`), many
    short-lived arrays between the long-lived blocks of the queues it fills; in an arena of its
    own the freed holes were not reused by the event loop's allocations: joaderd's private
    memory after 3 warm epochs of 128k items was 475 bytes per cached item, 429 with one arena
    (after the first epoch, issue 37's figure: 425 and 406). The cost is contention on one
    arena's lock; gRPC's own threads allocate outside the GIL. Measured once, 128k items warm:
    10.4 us of main CPU per delivery with one arena, 10.0 without (within the host's noise).

    NOTE: glibc's thresholds adapt: once an array above the mmap threshold (128 KiB at first) is
    freed, the threshold rises to its size and the trim threshold to twice that. An epoch start
    (`RefCntPolicy.add_refcounts` over every cached item) makes arrays of a few MB; after the
    first, such arrays came from the heap, and the holes they left stayed with the process: at
    the end of warm epochs of 128k items, 84.3 to 88.9 MiB of private memory, changing from one
    epoch to the next. Fixed thresholds (which turn the adaptation off) map such arrays and give
    them back: 81.6 to 83.1 MiB. Keeping them in the heap with a fixed 1 MiB trim threshold
    (the top trimmed, the holes not) measured 83.9 to 89.0 MiB, as with no setting. The cost of
    mapping is a page fault for each page of each such array: a few per epoch start, and at an
    attach and a close: for a 640k-item job with 1.28M items cached, 55 ms of the policy's CPU
    against 35 (`RefCntPolicy.add_refcounts` alone, half the items added and taken back)."""
    _mallopt((_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, MAIN_MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, MAIN_TRIM_THRESHOLD))
