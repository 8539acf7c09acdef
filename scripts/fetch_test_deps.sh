#!/usr/bin/env bash
# Fetch what the test suite needs beyond `pip install -e '.[test,engine]'`; scripts/test.sh runs
# this first, so the README's test command works on a fresh machine by itself.
#
# Today that is the amd-aiter wheel: tests/test_aiter_contract.py reads its source (never
# installs or imports it) from .whl/. Idempotent: nothing is downloaded when the wanted wheel is
# already in .whl/ or AITER_ATTN_AITER_WHEEL points the test elsewhere. AITER_SPEC overrides
# what is fetched (a pip requirement such as `amd-aiter==0.1.8`, or a path/URL of a wheel).
# A failed download does not stop the suite: it is reported here, and the contract test then
# FAILS loudly (it never skips).
set -uo pipefail
cd "$(dirname "$0")/.."

[ -n "${AITER_ATTN_AITER_WHEEL:-}" ] && exit 0

spec="${AITER_SPEC:-amd-aiter==0.1.7.post2.dev18}"
case "$spec" in
  amd-aiter==*|amd_aiter==*) want="amd_aiter-${spec#*==}-*.whl" ;;
  *.whl) want="$(basename "$spec")" ;;
  *) want="" ;;   # any other requirement: let pip decide (it reuses a file already in .whl/)
esac
if [ -n "$want" ] && compgen -G ".whl/$want" >/dev/null; then
  exit 0
fi

echo "fetching $spec into .whl/ for tests/test_aiter_contract.py" >&2
if ! python -m pip download -q --no-deps -d .whl "$spec"; then
  echo "ERROR: could not download $spec into .whl/: tests/test_aiter_contract.py will FAIL." >&2
  echo "       Fix: run \`python -m pip download --no-deps -d .whl '$spec'\` where the package" >&2
  echo "       index is reachable, or set AITER_ATTN_AITER_WHEEL to a wheel or source tree." >&2
fi
exit 0
