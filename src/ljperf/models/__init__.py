"""Models: the catalog, ``ModelSpec`` (config facts, parameter counts, FLOPs), builds, the training micro-step."""
