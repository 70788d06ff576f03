"""Run ljperf as ``python -m ljperf``."""

from ljperf.cli import main

raise SystemExit(main())
