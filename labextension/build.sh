#!/usr/bin/env bash
# Builds meshlab/labextension/ from src/ and style/. The build is committed, so installing
# meshlab needs no Node.js. built-from.sha256 records the sources it was built from:
# tests/notebook/test_lab_settings.py fails when they changed since (rerun this script with
# the environment's jupyterlab importable).
set -euo pipefail
cd "$(dirname "$0")"
npm ci --no-audit --no-fund --loglevel=error
core=$(python -c 'import jupyterlab, pathlib; print(pathlib.Path(jupyterlab.__file__).parent / "staging")')
rm -rf ../meshlab/labextension
node node_modules/@jupyterlab/builder/lib/build-labextension.js --core-path "$core" . >/dev/null
sha256sum package.json package-lock.json src/*.js style/*.css > built-from.sha256
echo "built: $(ls ../meshlab/labextension/static | tr '\n' ' ')"
