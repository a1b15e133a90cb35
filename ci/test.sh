#!/usr/bin/env bash
# The project's test command (README): the whole suite except tests marked slow.
set -euo pipefail
cd "$(dirname "$0")/.."
export TRITON_INTERPRET=1
exec python3 -m pytest -q -m "not slow" "$@"
