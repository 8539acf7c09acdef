#!/usr/bin/env bash
# Fetch what the test suite needs beyond `pip install -e '.[test,engine]'`; scripts/test.sh runs
# this first, so the README's test command works on a fresh machine by itself.
#
# Today that is two wheels whose source contract tests read (never install or import) from
# .whl/: amd-aiter (tests/test_aiter_contract.py) and sglang (tests/test_sglang_*.py).
# Idempotent: nothing is downloaded when the wanted wheel is already in .whl/ or
# AITER_ATTN_AITER_WHEEL / AITER_ATTN_SGLANG_WHEEL points the tests elsewhere. AITER_SPEC /
# SGLANG_SPEC override what is fetched (a pip requirement such as `amd-aiter==0.1.8`, or a
# path/URL of a wheel). A failed download does not stop the suite: it is reported here, and
# the contract tests then FAIL loudly (they never skip).
set -uo pipefail
cd "$(dirname "$0")/.."

# fetch VAR SPEC TESTS: download SPEC into .whl/ unless $VAR is set or the wheel is there
fetch() {
  local var="$1" spec="$2" tests="$3" want name
  [ -n "${!var:-}" ] && return 0
  case "$spec" in
    *==*) name="${spec%%==*}"; want="${name//-/_}-${spec#*==}-*.whl" ;;
    *.whl) want="$(basename "$spec")" ;;
    *) want="" ;;   # any other requirement: let pip decide (it reuses a file already in .whl/)
  esac
  if [ -n "$want" ] && compgen -G ".whl/$want" >/dev/null; then
    return 0
  fi
  echo "fetching $spec into .whl/ for $tests" >&2
  if ! python -m pip download -q --no-deps -d .whl "$spec"; then
    echo "ERROR: could not download $spec into .whl/: $tests will FAIL." >&2
    echo "       Fix: run \`python -m pip download --no-deps -d .whl '$spec'\` where the package" >&2
    echo "       index is reachable, or set $var to a wheel or source tree." >&2
  fi
}

fetch AITER_ATTN_AITER_WHEEL "${AITER_SPEC:-amd-aiter==0.1.7.post2.dev18}" \
  tests/test_aiter_contract.py
fetch AITER_ATTN_SGLANG_WHEEL "${SGLANG_SPEC:-sglang==0.5.23}" "tests/test_sglang_*.py"
exit 0
