# Sourced by scripts/*: make .venv (idempotent) for what the script runs.
#   source scripts/_venv.sh demo   torch (the CPU build) and aiockpt with its runtime dependencies
#   source scripts/_venv.sh dev    that, plus the development tools and every plugin (the tests)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv_for=${1:-dev}
if [ ! -x .venv/bin/python ]; then
  echo "== making .venv"
  "${PYTHON:-python3}" -m venv .venv
fi
pip_install() {  # pip, showing what it collects and installs; fails when pip fails
  local status
  status=$(mktemp)
  { .venv/bin/python -m pip install --disable-pip-version-check --progress-bar off \
      -c constraints.txt "$@"; echo $? >"$status"; } \
    | { grep --line-buffered -E '^(Collecting|Successfully installed)' || true; }
  return "$(cat "$status"; rm -f "$status")"
}
# Reinstalled when a pyproject.toml or constraints.txt is newer than the stamp.
stale() {
  [ ! -f "$1" ] || [ -n "$(find pyproject.toml constraints.txt plugins tests/plugins \
     -name pyproject.toml -newer "$1" -o -name constraints.txt -newer "$1" 2>/dev/null)" ]
}
if stale .venv/.aiockpt-demo; then
  # torch first and pinned: the CPU build; a bare "torch" could pull a multi-GB CUDA build.
  echo "== installing torch 2.13.0 (the CPU build)"
  pip_install torch==2.13.0 numpy  # numpy: torch warns at import without it
  echo "== installing aiockpt and its runtime dependencies"
  # compat: the checkout's folder goes on sys.path, so the package is found even where a
  # folder named aiockpt (this checkout, seen from beside it) would shadow the default
  # editable install's import hook as an empty namespace package.
  pip_install -e . --config-settings editable_mode=compat
  touch .venv/.aiockpt-demo
fi
if [ "$venv_for" = dev ]; then
  # Editable installs of every plugin in plugins/ (and test-only plugins), with its "test"
  # extra where it has one (what its tests need, such as an emulator).
  pkgs=(-e ".[dev]" --config-settings editable_mode=compat)
  for p in plugins/*/ tests/plugins/*/; do
    [ -f "$p/pyproject.toml" ] || continue
    if grep -q '^test = ' "$p/pyproject.toml"; then pkgs+=(-e "$p[test]"); else pkgs+=(-e "$p"); fi
  done
  if stale .venv/.aiockpt-installed; then
    echo "== installing the development tools and the plugins"
    pip_install "${pkgs[@]}"
    touch .venv/.aiockpt-installed
  fi
  # Azurite, the Azure Storage emulator of the aiockpt-azure tests, where Node.js is there
  # (without it those tests are skipped, saying why).
  azurite_version=3.37.0
  if command -v npm >/dev/null 2>&1 && command -v node >/dev/null 2>&1 \
     && ! grep -qs "\"version\": \"$azurite_version\"" .venv/azurite/node_modules/azurite/package.json; then
    echo "== installing azurite $azurite_version (the Azure Storage emulator)"
    npm install --prefix .venv/azurite --no-audit --no-fund --loglevel=error --no-save \
      "azurite@$azurite_version" >/dev/null 2>&1 \
      || echo "npm could not install azurite: the Azure storage tests will be skipped" >&2
  fi
fi
export PATH="$PWD/.venv/bin:$PATH"
