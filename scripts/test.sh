#!/usr/bin/env bash
# Installs everything the tests need, makes sure Redis and PostgreSQL answer, runs the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
eval "$(bash scripts/services.sh)"
export REDIS_URL DATABASE_URL
# One pytest worker a core, at most four (most tests are single-threaded Python:
# the Triton interpreter, the servers); `-n 0` among the arguments runs in one process.
workers=${EDGESERVE_TEST_WORKERS:-$(nproc)}
if [ "$workers" -gt 4 ]; then workers=4; fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "$workers" --dist worksteal "$@"
