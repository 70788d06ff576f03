"""Run ljperf as ``python -m ljperf``."""

from ljperf.cli import entry

entry()
