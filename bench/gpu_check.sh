#!/bin/sh
# The GPU checks of bench/gpu_check.py on a machine with no package index, from the repository root.
#
# Here (with network), once: bench/gpu_carry.sh fills .gpu/ (wheels for Python 3.12); bench/gpu_stubs/ray
# stands in for Ray, which verl imports and its training engine never calls.
# There: the device tool runs `sh bench/gpu_check.sh` with carry [".gpu"] and a timeout of about 540 s;
# results go to $OUT (gpu.log, gpu_check.json, quickstart.log).
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .gpu/site \
  .gpu/whl/*.whl .gpu/qs/*.whl || exit 3
[ -d .gpu/models ] && export ROLLWIRE_CACHE_DIR="$PWD/.gpu/models"   # a carried warm start, if any
export PYTHONPATH="$PWD/.gpu/site:$PWD/bench/gpu_stubs:$PWD" PYTHONUNBUFFERED=1 PATH="$PWD/.gpu/site/bin:$PATH"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$OUT/gpu.log"
python3 bench/gpu_check.py --out "$OUT" "$@" 2>&1 | tee -a "$OUT/gpu.log"
