#!/usr/bin/env bash
# What the SQL of local mode costs on this machine, with no client library:
# pgbench runs the bare handler and the idempotent variants interleaved in
# one run (-M prepared; pipeline mode where idem pipelines), and this prints
# each one's median latency and its ratio to the bare handler. idem_pipelined
# is local mode's round trips as idem sends them, idem_local as it sent them
# before its statements rode on BEGIN and COMMIT; record_0014 is record_only into the
# record table as it was before migration 15 (layout_0014.sql). business_key
# is create_once's statement for a new key (the key on the payment row,
# keyed_payments.sql), keyed_plain the bare handler writing that table.
#
#   examples/pgbench/run.sh [URL] [-c CLIENTS] [-T SECONDS]
#
# pgbench runs every script on one connection, and on a machine of few
# cores a backend used back to back runs in a slower placement against
# pgbench (pinning both to one core takes the difference away), so its bare
# call is slower and its ratios lower than bench_idempotent's (a connection
# per contender). To compare the two in one placement, pin
# the server and the client to one core (docs/c1.md).
#
# URL: a server to create a scratch database on (default
# postgres://postgres@127.0.0.1:5432/postgres). The database gets idem's
# migrations (the SQL files of idem-runtime/migrations), the tables of
# examples/bench_idempotent and the earlier record table, and is dropped at
# the end.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
url="postgres://postgres@127.0.0.1:5432/postgres"
clients=1
seconds=40
while [ $# -gt 0 ]; do
    case "$1" in
        -c) clients="$2"; shift 2 ;;
        -T) seconds="$2"; shift 2 ;;
        *) url="$1"; shift ;;
    esac
done
db="idem_pgbench_$$"
work="$(mktemp -d)"
cleanup() {
    psql -q "$url" -c "DROP DATABASE IF EXISTS $db" >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT
psql -q "$url" -c "CREATE DATABASE $db"
scratch="${url%/*}/$db"
for migration in "$here"/../../idem-runtime/migrations/*.sql; do
    psql -q -v ON_ERROR_STOP=1 "$scratch" -f "$migration" >/dev/null
done
psql -q -v ON_ERROR_STOP=1 "$scratch" -f "$here/schema.sql"
psql -q -v ON_ERROR_STOP=1 "$scratch" -f "$here/layout_0014.sql"
psql -q -v ON_ERROR_STOP=1 "$scratch" -f "$here/keyed_payments.sql"
names=(bare idem_pipelined record_only sequential idem_local record_0014 keyed_plain business_key)
args=()
for name in "${names[@]}"; do args+=(-f "$here/$name.sql@1"); done
pgbench -M prepared -n -c "$clients" -j 1 -T "$seconds" -l --log-prefix="$work/log" "${args[@]}" "$scratch" >/dev/null
# Per-transaction log lines: client, transaction, latency (us), script, ...
median() {
    awk -v s="$1" '$4 == s { print $3 }' "$work"/log* | sort -n |
        awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}
bare="$(median 0)"
line="clients=$clients"
for s in "${!names[@]}"; do
    m="$(median "$s")"
    line="$line $(awk -v n="${names[$s]}" -v m="$m" -v b="$bare" 'BEGIN { printf "%s_us=%.0f %s_ratio=%.2f", n, m, n, m / b }')"
done
echo "$line"
