"""The wire protocol: joader.proto's generated modules (regenerate with `make proto`) and the
constants that server and client must agree on."""

# The exception class name of a failed call travels in this trailing-metadata key.
ERROR_METADATA_KEY = "joader-error"
# A serialized BitMap of a large, scattered subset of a big source can exceed gRPC's 4 MB default.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # A restarted joaderd must be found within about a second, not after gRPC's default
    # reconnect backoff (which grows to two minutes).
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # A fresh channel gets fresh connections: the process-wide subchannel pool would hand it
    # the old channel's, still backing off after the outage, and its first call would fail.
    ("grpc.use_local_subchannel_pool", 1),
]

# Item dtypes on the wire (NextResponse.dtypes holds indices into this tuple). Append only.
DTYPES = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64", "float16",
          "float32", "float64", "bool")
DTYPE_CODES = {name: code for code, name in enumerate(DTYPES)}
