# Sourced by deploy/render-manifests and tests/deploy/run: prepares the Python
# environment for the deploy tooling, idempotently, from PyPI only, and sets
# $PY. Needs ROOT (the repository root). The first run downloads about 100 MB
# (kubernetes-validate bundles every Kubernetes JSON schema; helm-python-sdk
# bundles Helm's Go SDK as a shared library); later runs are offline.
#   ACCORD_DEPLOY_VENV  where the virtual environment lives
#                       (default: $ROOT/build-deploy/venv, git-ignored)
VENV=${ACCORD_DEPLOY_VENV:-$ROOT/build-deploy/venv}
if [[ ! -x "$VENV/bin/python" ]]; then
  python3 -m venv "$VENV" || {
    echo "deploy: could not create a virtual environment at $VENV; install python3-venv (apt-get install python3-venv)" >&2
    exit 1
  }
fi
PY=$VENV/bin/python
_pip() { "$PY" -m pip install --quiet --disable-pip-version-check "$@"; }
if ! "$PY" -c 'import kubernetes_validate, yaml, jsonschema' 2>/dev/null; then
  echo "deploy: installing kubernetes-validate and pyyaml into $VENV" >&2
  _pip "kubernetes-validate==1.37.0" "pyyaml>=6"
fi
# Helm's template engine (Helm v4.2 Go SDK through ctypes). Helm is not in
# Debian 12; this wheel is the only offline Helm from the allowed registries.
if ! "$PY" -c 'import helm_python' 2>/dev/null; then
  echo "deploy: installing helm-python-sdk into $VENV" >&2
  _pip "helm-python-sdk==0.2.2" \
    || echo "deploy: warning: helm-python-sdk did not install; chart rendering checks will be skipped" >&2
fi
export PY
