#!/usr/bin/env bash
# Build the wheel and the sdist with `python -m build`, install each into a fresh virtual
# environment and run a smoke test there (from outside the repository, so the installed copy
# is the one imported). The venv sees the system's site-packages for torch/pyro (no multi-GB
# download) and the build uses the installed setuptools (no isolation); the smoke test checks that pyro_cvi itself is imported from the venv.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
python -m build --no-isolation --outdir "$WORK/dist" . > "$WORK/build.log" 2>&1 || { cat "$WORK/build.log"; exit 1; }
ls "$WORK/dist"
for kind in whl tar.gz; do
  python -m venv --system-site-packages "$WORK/venv-$kind"
  "$WORK/venv-$kind/bin/python" -m pip install -q --no-deps --no-build-isolation "$WORK"/dist/*."$kind"
  (cd "$WORK" && "$WORK/venv-$kind/bin/python" "$ROOT/scripts/smoke_test.py" "$WORK/venv-$kind")
done
echo "wheel and sdist: built, installed in fresh venvs, smoke test passed"
