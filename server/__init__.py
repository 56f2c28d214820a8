"""joaderd, installed as `joader.server`: the registry, the gRPC servicer, the decode pool, config.

Run it as `joaderd --source NAME=PATH` or `python -m joader.server`.
"""
