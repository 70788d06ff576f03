"""The bottom layer: errors, units, options, recompute plans, DeepSpeed config files, records, cache, console."""
