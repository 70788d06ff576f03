"""Records read back are checked before anything uses them: the schema version known, every number finite, the
fields of a benchmark record as its JSON schema says (``schemas/benchmark-result.schema.json``).

Run: ``problem = record_problem(record)`` in every reader of records (``ljperf report``, ablation resume,
``ljperf plan --calibrate``); None for a good record, else one short phrase naming the field. Python's JSON reader
accepts ``NaN`` and ``Infinity``, so a record edited or damaged outside ljperf can hold numbers ljperf never writes.
"""

from __future__ import annotations

import functools
import json
import math
from importlib import resources
from typing import Any

from ljperf.core.records import SCHEMA_VERSION

SCHEMAS = {"benchmark": "benchmark-result.schema.json"}
"""Record kinds with a JSON schema; other kinds (an ablation's crash record) are checked for version and numbers."""
SHOWN = 80
"""Characters of a schema message a problem keeps."""
_JSON_NAMES = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def record_problem(record: Any) -> str | None:
    """What makes ``record`` unusable, naming the field (``results.peak_allocated_bytes is NaN``), or None."""
    if not isinstance(record, dict):
        return "not a JSON object"
    version = record.get("schema_version")
    if type(version) is not int or version != SCHEMA_VERSION:
        return f"schema_version {_shown(version)} is not one this ljperf reads ({SCHEMA_VERSION})"
    if (where := _not_finite(record, "")) is not None:
        return where
    kind = record.get("kind")
    schema = SCHEMAS.get(kind) if isinstance(kind, str) else None
    return _schema_problem(record, schema) if schema else None


def _not_finite(value: Any, path: str) -> str | None:
    """The first number in ``value`` that is NaN or infinite (``path`` is where ``value`` sits), as a phrase."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{path or 'the record'} is {_JSON_NAMES.get(repr(value), repr(value))}, not a finite number"
    if isinstance(value, dict):
        inner = [(f"{path}.{key}" if path else str(key), v) for key, v in value.items()]
    elif isinstance(value, list):
        inner = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    else:
        return None
    return next((found for where, v in inner if (found := _not_finite(v, where)) is not None), None)


def _schema_problem(record: dict, schema_file: str) -> str | None:
    import jsonschema  # about 0.6 s to import: only where records are read back

    error = jsonschema.exceptions.best_match(_validator(schema_file).iter_errors(record))
    if error is None:
        return None
    where = ".".join(str(part) for part in error.absolute_path) or "the record"
    message = error.message if len(error.message) <= SHOWN else error.message[: SHOWN - 1] + "…"
    return f"{where}: {message}"


@functools.cache
def _validator(schema_file: str) -> Any:
    import jsonschema

    schema = json.loads(resources.files("ljperf").joinpath("schemas", schema_file).read_text())
    return jsonschema.Draft202012Validator(schema)


def _shown(value: Any) -> str:
    text = _JSON_NAMES.get(repr(value), repr(value)) if isinstance(value, float) else json.dumps(value)
    return text if len(text) <= 20 else text[:19] + "…"
