"""The image's version manifest: which builds of torch, DeepSpeed & co. the image was built with.

Run at image build time (docker/Dockerfile), before and after installing ljperf:
``python -m ljperf.doctor.manifest constraints > /etc/ljperf/constraints.txt`` pins the base image's builds;
``python -m ljperf.doctor.manifest write /etc/ljperf/manifest.json --base base.json`` records the final versions
and fails (exit 1) when the install replaced a build of the base image. ``ljperf doctor`` compares the installed
versions against the manifest (path: ``$LJPERF_MANIFEST``, default ``/etc/ljperf/manifest.json``).
Imports nothing beyond the standard library, so it runs before ljperf's dependencies are installed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from ljperf.core.records import installed_versions, now_iso, read_json, write_json

MANIFEST_ENV = "LJPERF_MANIFEST"
DEFAULT_MANIFEST = "/etc/ljperf/manifest.json"
MANIFEST_VERSION = 1
# The packages whose optimized builds a user must not reinstall over (distribution names).
WATCHED: tuple[str, ...] = (
    "torch",
    "deepspeed",
    "transformers",
    "megatron-core",
    "transformer-engine",
    "vllm",
    "triton",
)


def manifest_path() -> Path:
    return Path(os.environ.get(MANIFEST_ENV) or DEFAULT_MANIFEST)


def new_manifest(*, base_image: str | None = None) -> dict[str, Any]:
    return {
        "schema_version": MANIFEST_VERSION,
        "kind": "manifest",
        "created": now_iso(),
        "base_image": base_image,
        "packages": installed_versions(WATCHED),
    }


def replaced(base: dict[str, str | None], now: dict[str, str | None]) -> list[str]:
    """Packages of ``base`` whose version changed or that disappeared, as ``name: old → new`` lines."""
    return [
        f"{name}: {old} → {now.get(name) or 'removed'}" for name, old in base.items() if old and now.get(name) != old
    ]


def constraints(versions: dict[str, str | None]) -> str:
    """A pip constraints file pinning every installed watched package to its exact build."""
    return "".join(f"{name}=={version}\n" for name, version in versions.items() if version)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ljperf.doctor.manifest", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("constraints", help="print pip constraints pinning the installed builds")
    write = sub.add_parser("write", help="write the manifest of the installed builds")
    write.add_argument("path", help="where the manifest goes, e.g. /etc/ljperf/manifest.json")
    write.add_argument("--base", help="a manifest written before the install: fail if a build was replaced")
    write.add_argument("--base-image", help="the image the build started from, recorded in the manifest")
    args = parser.parse_args(argv)
    if args.action == "constraints":
        sys.stdout.write(constraints(installed_versions(WATCHED)))
        return 0
    manifest = new_manifest(base_image=args.base_image)
    if args.base:
        changed = replaced(read_json(args.base)["packages"], manifest["packages"])
        if changed:
            print("the install replaced builds of the base image: " + "; ".join(changed), file=sys.stderr)
            return 1
    Path(args.path).parent.mkdir(parents=True, exist_ok=True)
    write_json(args.path, manifest)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
