#!/usr/bin/env bash
# Installs everything the tests need, makes sure Redis and PostgreSQL answer, runs the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
# The dashboard's browser test drives Debian's Chromium (tests/integration/test_dashboard.py).
if ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
        apt-get update -qq && apt-get install -y -qq chromium
    else
        echo "no chromium: the dashboard's browser test will skip (apt-get install chromium)" >&2
    fi
fi
eval "$(bash scripts/services.sh)"
export REDIS_URL DATABASE_URL
# One pytest worker a core, at most four (most tests are single-threaded Python:
# the Triton interpreter, the servers); `-n 0` among the arguments runs in one process.
workers=${EDGESERVE_TEST_WORKERS:-$(nproc)}
if [ "$workers" -gt 4 ]; then workers=4; fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "$workers" --dist worksteal "$@"
