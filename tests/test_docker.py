"""docker/Dockerfile, checked without a Docker engine: it parses, its pins agree with pyproject.toml, its
defaults are the image's rules, and its manifest steps run as written (against a temporary /etc/ljperf)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser
from packaging.requirements import Requirement
from packaging.version import Version

import ljperf
from ljperf.commands.doctor import CHECKS, skipped
from ljperf.doctor import manifest
from ljperf.doctor.tables import DRIVER_RULES

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "docker" / "Dockerfile"


@pytest.fixture(scope="module")
def parsed() -> DockerfileParser:
    parser = DockerfileParser(path=str(DOCKERFILE))
    assert parser.structure, "the Dockerfile parsed to nothing"
    return parser


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def instructions(parsed: DockerfileParser, name: str) -> list[str]:
    return [i["value"] for i in parsed.structure if i["instruction"] == name]


def test_parses_into_known_instructions(parsed):
    known = {"ARG", "FROM", "LABEL", "ENV", "WORKDIR", "COPY", "RUN", "HEALTHCHECK", "CMD", "COMMENT"}
    assert {i["instruction"] for i in parsed.structure} <= known
    assert [i["instruction"] for i in parsed.structure if i["instruction"] != "COMMENT"][:2] == ["ARG", "FROM"]


def test_base_is_a_multi_arch_ngc_pytorch_image_with_cuda_13_1(parsed):
    base = parsed.args["BASE_IMAGE"]
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", base), base
    assert parsed.baseimage == base  # FROM ${BASE_IMAGE}, resolved
    # No --platform pin and nothing architecture-specific: buildx builds each platform from the base's own variant.
    assert not any("--platform" in v for v in instructions(parsed, "FROM"))
    assert not re.search(r"x86_64|amd64|aarch64|arm64", " ".join(instructions(parsed, "RUN")))
    cuda = parsed.labels["ljperf.base.cuda"]
    assert cuda == "13.1" and cuda in DRIVER_RULES  # doctor has the driver rule for the image's CUDA


def test_pins_agree_with_pyproject(parsed, pyproject):
    project = pyproject["project"]
    assert parsed.labels["org.opencontainers.image.version"] == project["version"] == ljperf.__version__
    # The base's torch must satisfy ljperf's torch range, or pip would replace it. pip accepts an installed
    # pre-release build (NGC ships 2.x.0a0+hash) when it is inside the range.
    torch_range = next(Requirement(d) for d in project["dependencies"] if Requirement(d).name == "torch").specifier
    assert torch_range.contains(Version(parsed.labels["ljperf.base.torch"]), prereleases=True)
    installs = [v for v in instructions(parsed, "RUN") if "pip install" in v]
    assert len(installs) == 1
    extras = re.search(r'"\.\[([a-z,-]+)\]"', installs[0]).group(1).split(",")
    assert "deepspeed" in extras and set(extras) <= set(project["optional-dependencies"])
    assert "--constraint /etc/ljperf/constraints.txt" in installs[0]
    for source in instructions(parsed, "COPY"):
        for path in source.split()[:-1]:
            assert (ROOT / path).exists(), f"COPY {path}: not in the repository"
    # README.md is the package's readme: the build needs it.
    assert project["readme"] == "README.md" and "README.md" in " ".join(instructions(parsed, "COPY"))


def test_image_defaults_and_health_check(parsed):
    env = parsed.envs
    assert env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert env["COMPILE_OPTIMIZATION"] == "true"
    assert "CHECKPOINT_OPTIMIZATION" not in env  # opt-in
    assert env[manifest.MANIFEST_ENV] == manifest.DEFAULT_MANIFEST
    health = instructions(parsed, "HEALTHCHECK")
    assert len(health) == 1
    command = json.loads(health[0].split("CMD", 1)[1])
    assert command[:2] == ["ljperf", "doctor"]
    assert skipped(command[command.index("--skip") + 1]) <= set(CHECKS)  # the flags the real CLI accepts
    assert json.loads(instructions(parsed, "CMD")[0]) == ["ljperf", "doctor"]


def test_dockerignore_keeps_the_context_small():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv"} <= set(ignored)


def test_manifest_steps_run_as_written(parsed, tmp_path):
    """The RUN steps that call the manifest module, run here with /etc/ljperf moved to a temporary folder."""
    steps = [v for v in instructions(parsed, "RUN") if "ljperf.doctor.manifest" in v]
    assert len(steps) == 2
    etc = tmp_path / "etc-ljperf"
    env = {**os.environ, "BASE_IMAGE": parsed.args["BASE_IMAGE"]}
    for step in steps:
        script = step.replace("/etc/ljperf", str(etc)).replace("python -m", f"{shlex.quote(sys.executable)} -m")
        proc = subprocess.run(["bash", "-ec", script], cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        assert proc.returncode == 0, proc.stderr
    torch_dist = metadata.version("torch")  # a wheel's own version: 2.13.0+cpu, 2.11.0 (PyPI's CUDA build)
    assert f"torch=={torch_dist}" in (etc / "constraints.txt").read_text().split()
    final = json.loads((etc / "manifest.json").read_text())
    assert final["kind"] == "manifest" and final["base_image"] == parsed.args["BASE_IMAGE"]
    assert final["packages"]["torch"] == torch_dist
