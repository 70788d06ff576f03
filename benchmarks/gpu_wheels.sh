#!/usr/bin/env bash
# bash benchmarks/gpu_wheels.sh   (here, where PyPI is reachable; before benchmarks/gpu_session.sh on the device)
# The device machine (H200 image: Python 3.12, torch, transformers, accelerate, rich, matplotlib) has no package
# registry: this puts what ljperf's GPU checks need and it lacks (DeepSpeed, built without ops as a pure-Python
# wheel, and its pure-Python needs) into .whl/, which .git/info/exclude ignores; name ".whl" in the run's carry.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >>.git/info/exclude
mkdir -p .whl
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps -w .whl deepspeed==0.19.8
# typing_extensions: pydantic-core imports its Sentinel (4.14+), which the image's may predate
for spec in hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
    typing_extensions==4.16.0; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$spec"
done
# benchmarks/peers.py's torchtitan peer: torchtitan and its small pure-Python needs (about 2 MB). Its datasets and
# tensorboard imports (pyarrow, pandas, grpcio: over 100 MB, past the run's 64 MiB carry) must be the image's own;
# where they are not, the peer's row says which import failed. A download that fails only leaves the peer out.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl torchtitan==0.3.0 tyro torchdata \
    spmd_types==0.2.3 torch_checkpointing einops docstring-parser typeguard shtab || echo "torchtitan: not carried"
# The commit the device runs (its copy of the tree has no .git): gpu_session.sh logs it
echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' with uncommitted changes')" >.whl/REVISION
ls -l .whl
