from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AttachRequest(_message.Message):
    __slots__ = ("source", "indices", "name", "batch_size", "heartbeat", "rank", "world_size", "drop_last", "seed", "has_seed", "closing", "describe", "resume_epoch", "resume_consumed", "order", "resume_rest", "resume_share", "resume_base")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DROP_LAST_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    CLOSING_FIELD_NUMBER: _ClassVar[int]
    DESCRIBE_FIELD_NUMBER: _ClassVar[int]
    RESUME_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RESUME_CONSUMED_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    RESUME_REST_FIELD_NUMBER: _ClassVar[int]
    RESUME_SHARE_FIELD_NUMBER: _ClassVar[int]
    RESUME_BASE_FIELD_NUMBER: _ClassVar[int]
    source: str
    indices: bytes
    name: str
    batch_size: int
    heartbeat: bool
    rank: int
    world_size: int
    drop_last: bool
    seed: int
    has_seed: bool
    closing: bool
    describe: bool
    resume_epoch: int
    resume_consumed: bytes
    order: str
    resume_rest: bool
    resume_share: int
    resume_base: int
    def __init__(self, source: _Optional[str] = ..., indices: _Optional[bytes] = ..., name: _Optional[str] = ..., batch_size: _Optional[int] = ..., heartbeat: _Optional[bool] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., drop_last: _Optional[bool] = ..., seed: _Optional[int] = ..., has_seed: _Optional[bool] = ..., closing: _Optional[bool] = ..., describe: _Optional[bool] = ..., resume_epoch: _Optional[int] = ..., resume_consumed: _Optional[bytes] = ..., order: _Optional[str] = ..., resume_rest: _Optional[bool] = ..., resume_share: _Optional[int] = ..., resume_base: _Optional[int] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("job_id", "source", "classes", "num_source_items", "num_items", "image_size", "item_nbytes", "arena_path", "lease_s", "job_secret", "server_pid", "world_size", "rank", "num_rank_items", "seed", "targets", "stage", "item_shape", "item_dtype", "fingerprint", "class_labels", "notice", "next_address")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    NUM_SOURCE_ITEMS_FIELD_NUMBER: _ClassVar[int]
    NUM_ITEMS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    ITEM_NBYTES_FIELD_NUMBER: _ClassVar[int]
    ARENA_PATH_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    JOB_SECRET_FIELD_NUMBER: _ClassVar[int]
    SERVER_PID_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_RANK_ITEMS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    ITEM_SHAPE_FIELD_NUMBER: _ClassVar[int]
    ITEM_DTYPE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CLASS_LABELS_FIELD_NUMBER: _ClassVar[int]
    NOTICE_FIELD_NUMBER: _ClassVar[int]
    NEXT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    source: str
    classes: _containers.RepeatedScalarFieldContainer[bytes]
    num_source_items: int
    num_items: int
    image_size: int
    item_nbytes: int
    arena_path: str
    lease_s: float
    job_secret: bytes
    server_pid: int
    world_size: int
    rank: int
    num_rank_items: int
    seed: int
    targets: bytes
    stage: str
    item_shape: _containers.RepeatedScalarFieldContainer[int]
    item_dtype: str
    fingerprint: str
    class_labels: _containers.RepeatedScalarFieldContainer[int]
    notice: str
    next_address: str
    def __init__(self, job_id: _Optional[str] = ..., source: _Optional[str] = ..., classes: _Optional[_Iterable[bytes]] = ..., num_source_items: _Optional[int] = ..., num_items: _Optional[int] = ..., image_size: _Optional[int] = ..., item_nbytes: _Optional[int] = ..., arena_path: _Optional[str] = ..., lease_s: _Optional[float] = ..., job_secret: _Optional[bytes] = ..., server_pid: _Optional[int] = ..., world_size: _Optional[int] = ..., rank: _Optional[int] = ..., num_rank_items: _Optional[int] = ..., seed: _Optional[int] = ..., targets: _Optional[bytes] = ..., stage: _Optional[str] = ..., item_shape: _Optional[_Iterable[int]] = ..., item_dtype: _Optional[str] = ..., fingerprint: _Optional[str] = ..., class_labels: _Optional[_Iterable[int]] = ..., notice: _Optional[str] = ..., next_address: _Optional[str] = ...) -> None: ...

class NextRequest(_message.Message):
    __slots__ = ("job_id", "token", "max_items", "acks", "job_secret", "worker_id", "pid", "rank", "resume_epoch", "resume_consumed", "resume_parts", "max_batches", "stall_epoch", "stall_wait_s", "stall_step_s", "stall_items", "num_workers", "continue_epoch", "resume_rest", "resume_share", "resume_base")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    MAX_ITEMS_FIELD_NUMBER: _ClassVar[int]
    ACKS_FIELD_NUMBER: _ClassVar[int]
    JOB_SECRET_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RESUME_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RESUME_CONSUMED_FIELD_NUMBER: _ClassVar[int]
    RESUME_PARTS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCHES_FIELD_NUMBER: _ClassVar[int]
    STALL_EPOCH_FIELD_NUMBER: _ClassVar[int]
    STALL_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    STALL_STEP_S_FIELD_NUMBER: _ClassVar[int]
    STALL_ITEMS_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RESUME_REST_FIELD_NUMBER: _ClassVar[int]
    RESUME_SHARE_FIELD_NUMBER: _ClassVar[int]
    RESUME_BASE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    token: int
    max_items: int
    acks: _containers.RepeatedScalarFieldContainer[int]
    job_secret: bytes
    worker_id: int
    pid: int
    rank: int
    resume_epoch: int
    resume_consumed: bytes
    resume_parts: int
    max_batches: int
    stall_epoch: int
    stall_wait_s: float
    stall_step_s: float
    stall_items: int
    num_workers: int
    continue_epoch: int
    resume_rest: bool
    resume_share: int
    resume_base: int
    def __init__(self, job_id: _Optional[str] = ..., token: _Optional[int] = ..., max_items: _Optional[int] = ..., acks: _Optional[_Iterable[int]] = ..., job_secret: _Optional[bytes] = ..., worker_id: _Optional[int] = ..., pid: _Optional[int] = ..., rank: _Optional[int] = ..., resume_epoch: _Optional[int] = ..., resume_consumed: _Optional[bytes] = ..., resume_parts: _Optional[int] = ..., max_batches: _Optional[int] = ..., stall_epoch: _Optional[int] = ..., stall_wait_s: _Optional[float] = ..., stall_step_s: _Optional[float] = ..., stall_items: _Optional[int] = ..., num_workers: _Optional[int] = ..., continue_epoch: _Optional[int] = ..., resume_rest: _Optional[bool] = ..., resume_share: _Optional[int] = ..., resume_base: _Optional[int] = ...) -> None: ...

class FailedItem(_message.Message):
    __slots__ = ("item_id", "path", "reason")
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    item_id: int
    path: bytes
    reason: str
    def __init__(self, item_id: _Optional[int] = ..., path: _Optional[bytes] = ..., reason: _Optional[str] = ...) -> None: ...

class NextResponse(_message.Message):
    __slots__ = ("epoch", "end_of_epoch", "item_ids", "labels", "offsets", "failed", "lengths", "ndims", "dims", "dtypes", "arena", "checksums", "copy_now", "waiting", "rank_never_read", "waiting_s")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    END_OF_EPOCH_FIELD_NUMBER: _ClassVar[int]
    ITEM_IDS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    NDIMS_FIELD_NUMBER: _ClassVar[int]
    DIMS_FIELD_NUMBER: _ClassVar[int]
    DTYPES_FIELD_NUMBER: _ClassVar[int]
    ARENA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    COPY_NOW_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RANK_NEVER_READ_FIELD_NUMBER: _ClassVar[int]
    WAITING_S_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    end_of_epoch: bool
    item_ids: _containers.RepeatedScalarFieldContainer[int]
    labels: _containers.RepeatedScalarFieldContainer[int]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    failed: _containers.RepeatedCompositeFieldContainer[FailedItem]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    ndims: _containers.RepeatedScalarFieldContainer[int]
    dims: _containers.RepeatedScalarFieldContainer[int]
    dtypes: _containers.RepeatedScalarFieldContainer[int]
    arena: str
    checksums: _containers.RepeatedScalarFieldContainer[int]
    copy_now: bool
    waiting: str
    rank_never_read: bool
    waiting_s: float
    def __init__(self, epoch: _Optional[int] = ..., end_of_epoch: _Optional[bool] = ..., item_ids: _Optional[_Iterable[int]] = ..., labels: _Optional[_Iterable[int]] = ..., offsets: _Optional[_Iterable[int]] = ..., failed: _Optional[_Iterable[_Union[FailedItem, _Mapping]]] = ..., lengths: _Optional[_Iterable[int]] = ..., ndims: _Optional[_Iterable[int]] = ..., dims: _Optional[_Iterable[int]] = ..., dtypes: _Optional[_Iterable[int]] = ..., arena: _Optional[str] = ..., checksums: _Optional[_Iterable[int]] = ..., copy_now: _Optional[bool] = ..., waiting: _Optional[str] = ..., rank_never_read: _Optional[bool] = ..., waiting_s: _Optional[float] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...
