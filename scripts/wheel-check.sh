#!/usr/bin/env bash
# The wheel as a user gets it: built from this checkout, installed with the VM extra into a
# fresh venv that sees no system packages (so no pyverbs), then `hixl doctor` must find a
# runtime path (the host's device or the VM) and the README's first example must run there.
set -euo pipefail
cd "$(dirname "$0")/.."
work=build/wheel-check          # under the checkout: the VM has its own /tmp
rm -rf "$work"
mkdir -p "$work/dist"
.venv/bin/python -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation \
  -w "$work/dist" .
/usr/bin/python3 -m venv "$work/venv"
wheel=$(ls "$work"/dist/hixl-*.whl)
"$work/venv/bin/python" -m pip install -q --disable-pip-version-check "${wheel}[vm]"
"$work/venv/bin/hixl" doctor
# The README's first python block, as a user would paste it into example.py.
"$work/venv/bin/python" - "$work/example.py" <<'PY'
import re, sys
text = open("README.md").read()
open(sys.argv[1], "w").write(re.findall(r"```python\n(.*?)```", text, flags=re.S)[0])
PY
cd "$work"                      # not the checkout: `import hixl` must find the wheel's
"$PWD/venv/bin/hixl" run -- "$PWD/venv/bin/python" -c \
  'import hixl, runpy; assert "site-packages" in hixl.__file__, hixl.__file__; runpy.run_path("example.py"); print("wheel-check: the README example ran from", hixl.__file__)'
