#!/usr/bin/env bash
# Installs everything the tests need, makes sure Redis and PostgreSQL answer, runs the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
# Debian's packages some tests drive: Chromium for the dashboard's browser test
# (tests/integration/test_dashboard.py), docker-compose to check the compose file
# (tests/infra/test_compose.py); without them those tests skip and say why.
missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
        apt-get update -qq && apt-get install -y -qq "${missing[@]}"
    else
        echo "not installed: ${missing[*]}; the tests that drive them will skip" >&2
    fi
fi
eval "$(bash scripts/services.sh)"
export REDIS_URL DATABASE_URL
# One pytest worker a core and one more, at most four: most tests are single-threaded
# Python (the Triton interpreter, the servers), and many wait on real processes, servers
# and timeouts, which another worker's computing fills; `-n 0` runs in one process.
# Whole files to a worker, the longest first (tests/conftest.py, LONGEST_FIRST).
workers=${EDGESERVE_TEST_WORKERS:-$(( $(nproc) + 1 ))}
if [ "$workers" -gt 4 ]; then workers=4; fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "$workers" --dist loadfile "$@"
