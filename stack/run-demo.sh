#!/usr/bin/env bash
# `make run`: the demo config (stack/demo.yaml), a background row writer, and `dagster dev` on 127.0.0.1:3000.
# Expects the stack's env (stack.env); `make run` loads it and runs `python -m stack.demo setup` first.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"

if [[ -z "${ROWRELAY_PG_PASSWORD:-}" ]]; then
  env_file="${ROWRELAY_HOME:-$HOME/.cache/rowrelay}/stack.env"
  [[ -f "$env_file" ]] || { echo "run-demo: $env_file not found; run \`make stack\` first" >&2; exit 1; }
  set -a; source "$env_file"; set +a
fi

# ROWRELAY_DEMO_CONFIG, ROWRELAY_UI_PORT and ROWRELAY_DEMO_RATE=0 (no writer) let a test run this script on a
# config, port and Dagster database of its own (DAGSTER_PG_DB, ROWRELAY_DAGSTER_DIR) next to a running demo.
export ROWRELAY_CONFIG="${ROWRELAY_DEMO_CONFIG:-$ROOT/stack/demo.yaml}"
port="${ROWRELAY_UI_PORT:-3000}"
# dagster.yaml lives in the checkout; the dirs it points Dagster's own files at live under ROWRELAY_HOME.
export DAGSTER_HOME="$ROOT"
export ROWRELAY_DAGSTER_DIR="${ROWRELAY_DAGSTER_DIR:-${ROWRELAY_HOME:-$HOME/.cache/rowrelay}/dagster}"
mkdir -p "$ROWRELAY_DAGSTER_DIR"

if [[ ! -d "$ROOT/.venv" ]]; then
  echo "run-demo: no .venv; run \`make install\` first" >&2
  exit 1
fi

# Pools must exist before the daemon's first dequeue, else it may start two runs of one table at once.
"$ROOT/.venv/bin/python" -m stack.demo pools

if [[ "${ROWRELAY_DEMO_RATE:-3}" != 0 ]]; then
  # --exit-with-parent: after the exec below this shell *is* the supervisor, so the writer stops when it does.
  "$ROOT/.venv/bin/python" -m stack.demo write --rate "${ROWRELAY_DEMO_RATE:-3}" --exit-with-parent &
  writer=$!
  # Covers a failure before the exec (the trap does not survive exec).
  trap 'kill "$writer" 2>/dev/null || true' EXIT
fi

echo "rowrelay demo: Dagster UI at http://127.0.0.1:$port (config $ROWRELAY_CONFIG, Dagster files in $ROWRELAY_DAGSTER_DIR)"
# The supervisor runs `dagster dev` in a process group of its own and stops that whole group on one Ctrl-C
# (stack/supervise.py): `dagster dev` alone left its webserver, daemon and code servers running.
exec "$ROOT/.venv/bin/python" -m stack.supervise -- \
  "$ROOT/.venv/bin/dagster" dev -w "$ROOT/workspace.yaml" -h 127.0.0.1 -p "$port"
