# Sourced by the served benches (gpu_serve_core.sh, gpu_shared_prefix.sh, serve_gpu.sh):
# device_env.sh's wheels and PYTHONPATH (WHEELS, default .whl/server), a socket per stream
# allowed, and the server's imports checked before anything is started.
source bench/device_env.sh || exit 1
ulimit -n 65536 2>/dev/null || ulimit -n 8192  # 1,024 streams: a socket each, on both sides
python3 -c "import msgspec, fastapi, uvicorn" || {
  echo "missing wheels: put the server's cp312 wheels in WHEELS (default .whl/server)"; exit 1; }
