"""Run ljperf as ``python -m ljperf``."""

from ljperf.cli import entry

if __name__ == "__main__":  # not in a process spawned from it (``forecast.api.trace_ahead``)
    entry()
