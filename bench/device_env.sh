# Sourced by the device scripts (bench/gpu_*.sh), run from the repository root: the wheels the
# device image lacks (msgspec, which the engine imports; the server's packages; gguf for the GGUF
# tests: cp312 wheels, listed in gpu_serve_core.sh) installed from WHEELS (default .whl/server,
# git-ignored: the run tool's carry [".whl"]) into /tmp/site, and PYTHONPATH = /tmp/site, then
# the engine and operator sources. Without the wheels nothing is installed.
WHEELS=${WHEELS:-.whl/server}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl || exit 1
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$PWD/engine:$PWD/operator${PYTHONPATH:+:$PYTHONPATH}"
