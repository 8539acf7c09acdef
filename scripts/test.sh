#!/usr/bin/env bash
# The project's test command (README). Triton kernels run in the interpreter on CPU-only hosts.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  export TRITON_INTERPRET=1
fi
# what the tests need beyond the pip install (the amd-aiter wheel); idempotent, never fatal
./scripts/fetch_test_deps.sh
# one thread per worker: -n 2 on 2 cores oversubscribes badly otherwise
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"
exec python -m pytest -q -n "${PYTEST_WORKERS:-2}" "$@" tests
