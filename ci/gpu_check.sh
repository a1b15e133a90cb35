#!/usr/bin/env bash
# Run ci/gpu_check.py on a GPU machine whose image lacks some of the engine's dependencies.
#
#   ci/gpu_check.sh fetch-wheels   # here, with pip and a package index: fill .whl/ with the
#                                  # cp312 manylinux x86_64 wheels named below (gitignored)
#   ci/gpu_check.sh [ARGS...]      # on the GPU machine: install .whl/*.whl (if any) and the
#                                  # engine itself (its platforms are entry points) into a
#                                  # temp target, then run python3 ci/gpu_check.py ARGS...,
#                                  # the plugin conformance kit on each GPU platform and the
#                                  # Triton kernel tests compiled on the GPU (~4 min in all)
#
# The device tool carries at most 64 MiB of working tree: move tests/data/quant-fixtures/*
# except gptq-desc-act-g64 (section 3 uses it) out of the checkout for the call.
#
# Environment: PYTHON (default python3), WHEEL_PYTHON_VERSION (default 3.12),
# ENGINE_KIT_PLATFORMS, ENGINE_GPU_KERNEL_TESTS (0: skip), ENGINE_GPU_KERNEL_TESTS_TIMEOUT.
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
  # The engine's pytest plugin comes in through its pytest11 entry point (installed above).
  "$PY" -m pytest -q -p no:cacheprovider \
    --pyargs engine.testing.conformance --engine-platform "$platform" || status=1
done
# The Triton kernel tests (written for the interpreter on CPU tensors) compiled on this GPU,
# with their own float64 references: ci/gpu_kernel_shim.py moves each launcher's tensors.
# ENGINE_GPU_KERNEL_TESTS=0 skips them; ENGINE_GPU_KERNEL_TESTS_TIMEOUT bounds them (s).
# Deselected: tests of the interpreter's own rules (CPU tensors accepted by can_implement,
# a layer or engine built on the CPU device) and tests that launch their own jit kernels.
if [[ "${ENGINE_GPU_KERNEL_TESTS:-1}" != "0" ]] \
    && "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  echo "== Triton kernel tests on the GPU (ci/gpu_kernel_shim.py)"
  TRITON_INTERPRET=0 PYTHONPATH="ci:$PYTHONPATH" timeout "${ENGINE_GPU_KERNEL_TESTS_TIMEOUT:-180}" \
    "$PY" -m pytest -q -p no:cacheprovider -p gpu_kernel_shim -o addopts="" -rfE \
    tests/kernels/test_mla_attention.py tests/kernels/test_lora_kernels.py \
    tests/kernels/test_fused_moe.py tests/kernels/test_fused_moe_bias.py \
    tests/kernels/test_fused_moe_ungated.py tests/kernels/test_encoder_attention.py \
    tests/kernels/test_triton_attention.py tests/kernels/test_reshape_and_cache.py \
    tests/kernels/test_fp8_kv.py tests/kernels/ssm/test_ssm_ops.py \
    -k "not can_implement and not kernel_selection and not runs_ungated_experts \
and not every_code_decodes and not encoding_is_quantize_kv and not matches_the_cpu_backend" \
    || status=1
fi
exit $status
