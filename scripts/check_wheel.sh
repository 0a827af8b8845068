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
# the sdist ships the package and its metadata, not the repository's tests (see MANIFEST.in)
SDIST_FILES=$(tar tzf "$WORK"/dist/*.tar.gz)
if grep -q '^[^/]*/tests/' <<<"$SDIST_FILES"; then echo "the sdist ships tests/"; exit 1; fi
for f in LICENSE README.md CHANGELOG.md CITATION.cff pyro_cvi/py.typed; do
  grep -q "^[^/]*/$f\$" <<<"$SDIST_FILES" || { echo "the sdist lacks $f"; exit 1; }
done
for kind in whl tar.gz; do
  python -m venv --system-site-packages "$WORK/venv-$kind"
  "$WORK/venv-$kind/bin/python" -m pip install -q --no-deps --no-build-isolation "$WORK"/dist/*."$kind"
  (cd "$WORK" && "$WORK/venv-$kind/bin/python" "$ROOT/scripts/smoke_test.py" "$WORK/venv-$kind")
done
echo "wheel and sdist: built, installed in fresh venvs, smoke test passed"
