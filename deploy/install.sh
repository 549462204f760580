#!/bin/sh
# Installs rowrelay with the exact dependency versions of uv.lock into a new virtualenv: the recipe the code
# location's image runs (deploy/Dockerfile) and tests/test_deploy.py runs in a fresh directory, so it cannot rot.
#   deploy/install.sh VENV
set -eu
VENV=${1:?usage: deploy/install.sh VENV}
SRC=$(cd "$(dirname "$0")/.." && pwd)
UV_VERSION=0.13.9

python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "uv==$UV_VERSION"
UV="$VENV/bin/python -m uv"
# The lock's versions for everything rowrelay needs at run time (no test or lint tools).
$UV export --project "$SRC" --frozen --no-dev --no-emit-project --no-hashes --quiet > "$VENV/requirements.txt"
$UV pip install --quiet --python "$VENV/bin/python" --compile-bytecode -r "$VENV/requirements.txt"
# Built from a copy of what the image holds, so the build writes nothing into the source tree.
BUILD=$(mktemp -d)
cp -R "$SRC/pyproject.toml" "$SRC/README.md" "$SRC/orchestration" "$SRC/assets" "$SRC/resources" "$BUILD/"
$UV pip install --quiet --python "$VENV/bin/python" --compile-bytecode --no-deps "$BUILD"
rm -rf "$BUILD"

# The publisher's per-row loop in C, next to the installed module that loads it; without a compiler rowrelay
# produces through confluent-kafka instead (slower) and says so in its log.
# -I: ask the installed copy, never a checkout in the working directory.
NATIVE=$("$VENV/bin/python" -I -c "import resources.arrow_produce as m; print(m.LIBRARY)")
if command -v cc >/dev/null 2>&1; then
    mkdir -p "$(dirname "$NATIVE")"
    cc -O2 -Wall -Werror -shared -fPIC -o "$NATIVE" "$SRC/resources/native/produce_rows.c"
else
    echo "deploy/install.sh: no C compiler: rows are produced through confluent-kafka"
fi
