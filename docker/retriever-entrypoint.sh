#!/bin/sh
# Entry point of the retriever images.
#   serve [emapg serve options]   build the index at $EMAPG_INDEX_DIR if absent (resumable), then serve it
#   <anything else>               run `emapg <anything else>`, e.g. `index build --corpus ... --out ...`
set -eu
INDEX_DIR="${EMAPG_INDEX_DIR:-/indexes/wiki_mini}"
if [ "${1:-serve}" != "serve" ]; then
    exec emapg "$@"
fi
[ "$#" -gt 0 ] && shift
if [ ! -f "$INDEX_DIR/meta.json" ]; then
    echo "no index at $INDEX_DIR: building it from $EMAPG_CORPUS (first start only; a restart resumes)" >&2
    emapg index build --corpus "$EMAPG_CORPUS" --out "$INDEX_DIR" \
        --encoder "${EMAPG_ENCODER:-minilm}" --index-type "${EMAPG_INDEX_TYPE:-Flat}" --device "${EMAPG_DEVICE:-auto}"
fi
# Inside a container the server must listen on all interfaces to be reachable through the
# published port. Without EMAPG_RETRIEVER_API_KEY it then refuses to start, unless EMAPG_INSECURE=1
# says the port is published on 127.0.0.1 only (as docker-compose.yml does).
INSECURE=""
[ "${EMAPG_INSECURE:-0}" = "1" ] && INSECURE="--insecure"
exec emapg serve --index "$INDEX_DIR" --host 0.0.0.0 --port "${EMAPG_PORT:-8000}" --device "${EMAPG_DEVICE:-auto}" $INSECURE "$@"
