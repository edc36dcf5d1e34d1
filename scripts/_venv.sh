# Sourced by scripts/*: make .venv with the project, its plugins and dev tools (idempotent).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
# Editable installs of the package and of every plugin in plugins/ (and test-only plugins).
pkgs=(-e ".[dev]")
for p in plugins/*/ tests/plugins/*/; do
  [ -f "$p/pyproject.toml" ] && pkgs+=(-e "$p")
done
stamp=.venv/.aiockpt-installed
if [ ! -f "$stamp" ] || [ -n "$(find pyproject.toml constraints.txt plugins tests/plugins \
     -name pyproject.toml -newer "$stamp" -o -name constraints.txt -newer "$stamp" 2>/dev/null)" ]; then
  # torch first and pinned: the CPU build; a bare "torch" could pull a multi-GB CUDA build.
  .venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt torch==2.13.0
  .venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt "${pkgs[@]}"
  touch "$stamp"
fi
export PATH="$PWD/.venv/bin:$PATH"
