# Sourced by scripts/demo.sh and scripts/test.sh: make sure .venv holds loopvq-calib with its dev tools.
# Creates .venv and installs `-e ".[dev]"` with CPU torch pinned by constraints-cpu.txt (so pip does not pull a
# multi-GB CUDA build) when .venv is missing, or when pyproject.toml / constraints-cpu.txt changed since the
# install these scripts made. A .venv you made yourself (e.g. on a GPU machine) is used as it is once it
# imports loopvq_calib and pytest. Extra pip options go through pip's own variables (PIP_EXTRA_INDEX_URL ...).
stamp="$(cat pyproject.toml constraints-cpu.txt | sha256sum | cut -c1-16)"
if [ -f .venv/.loopvq-install ]; then
  [ "$(cat .venv/.loopvq-install)" = "$stamp" ] || need_install=1
elif [ -x .venv/bin/python ] && .venv/bin/python -c "import loopvq_calib, pytest" 2>/dev/null; then
  need_install=
else
  need_install=1
fi
if [ -n "${need_install:-}" ]; then
  echo "setup: installing loopvq-calib into .venv (CPU torch, about a minute)"
  [ -x .venv/bin/python ] || python3 -m venv .venv
  .venv/bin/python -m pip install -q --disable-pip-version-check -c constraints-cpu.txt -e ".[dev]"
  echo "$stamp" > .venv/.loopvq-install
fi
unset need_install stamp
