# Sourced by scripts/*: make .venv with the project, its plugins and dev tools (idempotent).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
# Editable installs of the package and of every plugin in plugins/ (and test-only plugins),
# with its "test" extra where it has one (what its tests need, such as an emulator).
pkgs=(-e ".[dev]")
for p in plugins/*/ tests/plugins/*/; do
  [ -f "$p/pyproject.toml" ] || continue
  if grep -q '^test = ' "$p/pyproject.toml"; then pkgs+=(-e "$p[test]"); else pkgs+=(-e "$p"); fi
done
stamp=.venv/.aiockpt-installed
if [ ! -f "$stamp" ] || [ -n "$(find pyproject.toml constraints.txt plugins tests/plugins \
     -name pyproject.toml -newer "$stamp" -o -name constraints.txt -newer "$stamp" 2>/dev/null)" ]; then
  # torch first and pinned: the CPU build; a bare "torch" could pull a multi-GB CUDA build.
  .venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt torch==2.13.0
  .venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt "${pkgs[@]}"
  touch "$stamp"
fi
# Azurite, the Azure Storage emulator of the aiockpt-azure tests, where Node.js is there
# (without it those tests are skipped, saying why).
azurite_version=3.37.0
if command -v npm >/dev/null 2>&1 && command -v node >/dev/null 2>&1 \
   && ! grep -qs "\"version\": \"$azurite_version\"" .venv/azurite/node_modules/azurite/package.json; then
  npm install --prefix .venv/azurite --no-audit --no-fund --loglevel=error --no-save \
    "azurite@$azurite_version" >/dev/null 2>&1 \
    || echo "npm could not install azurite: the Azure storage tests will be skipped" >&2
fi
export PATH="$PWD/.venv/bin:$PATH"
