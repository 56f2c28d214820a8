"""Generated gRPC and protobuf modules for joader.proto (regenerate with `make proto`)."""
