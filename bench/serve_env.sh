# Sourced by the served benches (gpu_serve_core.sh, gpu_shared_prefix.sh, serve_gpu.sh): the
# engine and operator sources on PYTHONPATH, the wheels the device image lacks installed from
# WHEELS (a folder; see gpu_serve_core.sh for the list) into /tmp/site, a socket per stream
# allowed, and the server's imports checked before anything is started.
ulimit -n 65536 2>/dev/null || ulimit -n 8192  # 1,024 streams: a socket each, on both sides
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/engine:$PWD/operator${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
python3 -c "import msgspec, fastapi, uvicorn" || { echo "missing wheels (WHEELS=...)"; exit 1; }
