"""Micro benches: one component measured alone or against one joaderd (the sampler, the cache's
books, the gRPC floor, the stages and decoders, delivery, the host partition, the drift simulation)."""
