#!/usr/bin/env bash
# The project's test command (README). Triton kernels run in the interpreter on CPU-only hosts.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  export TRITON_INTERPRET=1
fi
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"
exec python -m pytest -q -n "${PYTEST_WORKERS:-2}" "$@" tests
