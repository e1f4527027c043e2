#!/usr/bin/env bash
# Install (CPU torch pinned through constraints.txt, C++ engine built in place) and run the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -c constraints.txt torch==2.13.0
python -m pip install -q -c constraints.txt --no-build-isolation -e '.[test]'
python -m pytest -q "$@"
