"""``ljperf doctor``: the image's usage rules as checks, each with its fix (docs/doctor.md).

Run: ``ljperf doctor`` (table) or ``ljperf doctor --deepspeed-config ds.json --json``.
Checks live in ``checks.py``, their rules as data in ``tables.py``, the image's version manifest in ``manifest.py``.
This package imports nothing heavy at import time (``manifest`` runs before ljperf's dependencies exist).
"""
