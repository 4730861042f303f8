#!/usr/bin/env bash
# Makes sure the Redis and PostgreSQL the tests use answer; starts them from
# installed binaries when they do not; fails naming what to install otherwise.
# Prints the REDIS_URL / DATABASE_URL to export.
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
redis_url=${REDIS_URL:-redis://127.0.0.1:6379/0}
database_url=${DATABASE_URL:-postgresql://postgres@127.0.0.1:5432/postgres}

redis_ok() { "$py" -c "import redis,sys; redis.Redis.from_url(sys.argv[1], socket_timeout=2).ping()" "$1" 2>/dev/null; }
pg_ok() { "$py" -c "import psycopg,sys; psycopg.connect(sys.argv[1], connect_timeout=3).close()" "$1" 2>/dev/null; }

if ! redis_ok "$redis_url"; then
    if command -v redis-server >/dev/null; then
        dir=$(mktemp -d)
        redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
            --dir "$dir" --logfile "$dir/redis.log" >/dev/null
        redis_url=redis://127.0.0.1:6379/0
        for _ in $(seq 50); do redis_ok "$redis_url" && break; sleep 0.1; done
    fi
    redis_ok "$redis_url" || { echo "services: no Redis answers at $redis_url and redis-server is not installed (apt-get install redis-server)" >&2; exit 1; }
fi

if ! pg_ok "$database_url"; then
    if command -v pg_ctlcluster >/dev/null && ls /etc/postgresql/*/main >/dev/null 2>&1; then
        pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start || true
        for _ in $(seq 50); do pg_ok "$database_url" && break; sleep 0.2; done
    fi
    if ! pg_ok "$database_url"; then
        bindir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1 || true)
        if [ -n "$bindir" ] && [ -x "$bindir/initdb" ]; then
            data=$(mktemp -d); chown -R postgres "$data" 2>/dev/null || true
            run=(); [ "$(id -u)" = 0 ] && run=(runuser -u postgres --)
            "${run[@]}" "$bindir/initdb" -D "$data" -U postgres -A trust >/dev/null
            "${run[@]}" "$bindir/pg_ctl" -D "$data" -o "-p 55432 -k $data -c listen_addresses=127.0.0.1" -l "$data/log" start >/dev/null
            database_url=postgresql://postgres@127.0.0.1:55432/postgres
            for _ in $(seq 50); do pg_ok "$database_url" && break; sleep 0.2; done
        fi
    fi
    pg_ok "$database_url" || { echo "services: no PostgreSQL answers at $database_url and no server binaries were found (apt-get install postgresql)" >&2; exit 1; }
fi
echo "export REDIS_URL=$redis_url DATABASE_URL=$database_url"
