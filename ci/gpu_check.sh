#!/usr/bin/env bash
# Run ci/gpu_check.py on a GPU machine whose image lacks some of the engine's dependencies.
#
#   ci/gpu_check.sh fetch-wheels   # here, with pip and a package index: fill .whl/ with the
#                                  # cp312 manylinux x86_64 wheels named below (gitignored)
#   ci/gpu_check.sh [ARGS...]      # on the GPU machine: install .whl/*.whl (if any) and the
#                                  # engine itself (its platforms are entry points) into a
#                                  # temp target, then run python3 ci/gpu_check.py ARGS...
#
# Environment: PYTHON (default python3), WHEEL_PYTHON_VERSION (default 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# What `engine generate` imports that a bare CUDA image (torch, triton, transformers,
# tokenizers, safetensors, jinja2, click, pluggy, numpy, tqdm) lacks. Pure-Python ones are
# cheap to carry; pydantic-core and msgspec are compiled, hence the platform tags.
WHEELS=(
  pydantic==2.13.4
  pydantic-core==2.46.4
  annotated-types==0.7.0
  typing-inspection==0.4.2
  typing-extensions==4.16.0
  msgspec==0.23.0
)

if [[ "${1:-}" == "fetch-wheels" ]]; then
  mkdir -p .whl
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version "${WHEEL_PYTHON_VERSION:-3.12}" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
  ls .whl
  exit 0
fi

SITE=$(mktemp -d /tmp/engine-gpu-check-site.XXXXXX)
SRC=$(mktemp -d /tmp/engine-gpu-check-src.XXXXXX)
trap 'rm -rf "$SITE" "$SRC"' EXIT
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl
fi
# The in-tree platforms are found through the `engine` distribution's entry points; install
# a copy for its metadata, built from a temp copy so the tree gets no build debris
# (imports still come from this tree: gpu_check.py puts it first on the path).
if ! "$PY" -c "import importlib.metadata as m, sys; \
sys.exit(not any(e.name == 'cuda' for e in m.entry_points(group='engine.plugins')))"; then
  cp -r pyproject.toml README.md engine "$SRC/"
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
    --no-cache-dir --target "$SITE" "$SRC" \
    || echo "gpu_check.sh: could not install engine's metadata; --device cuda will be unknown"
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
status=0
"$PY" ci/gpu_check.py "$@" || status=$?
# The plugin conformance kit on every GPU platform this machine has (a platform that is
# not available here is skipped by the kit's platform fixture with the reason).
for platform in ${ENGINE_KIT_PLATFORMS:-cuda rocm xpu}; do
  "$PY" -c "from engine.core.plugins import get_plugin_registry as r; import sys; \
sys.exit(not any(p.name == '$platform' and p.available for p in r().platforms()))" 2>/dev/null \
    || continue
  echo "== conformance kit: --engine-platform $platform"
  "$PY" -m pytest -q -p no:cacheprovider -p engine.testing.pytest_plugin \
    --pyargs engine.testing.conformance --engine-platform "$platform" || status=1
done
exit $status
