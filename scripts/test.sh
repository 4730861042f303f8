#!/usr/bin/env bash
# Installs everything the tests need, makes sure Redis and PostgreSQL answer, runs the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
eval "$(bash scripts/services.sh)"
export REDIS_URL DATABASE_URL
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
