#!/usr/bin/env bash
# What a user gets from the package files: builds the sdist and the wheel, checks what each holds,
# installs the wheel into a fresh venv (torch's CPU wheel first) and runs an example from outside
# the repository; then runs a test from the unpacked sdist, as a packager would.
# Usage: .ci/package_check.sh (from anywhere; needs `build`, from the test extra, in the calling Python).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python="${PYTHON:-python3}"

"$python" -m build --outdir "$work/dist" "$repo" >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
# A deprecation warning of the build tools fails the check.
if grep -i "deprecat" "$work/build.log"; then
    echo "package_check: the build warns (above)"; exit 1
fi
sdist=("$work"/dist/*.tar.gz) wheel=("$work"/dist/*.whl)

# The sdist: the license and every test helper the tests import; no compiled kernel.
listing="$(tar -tzf "${sdist[0]}")"
for needed in LICENSE tests/helpers.py tests/grad_helpers.py tests/zoo.py tests/_ddp_activations.py \
              examples/quickstart.py lightning_hooks/measure/_cstats.c lightning_hooks/measure/_cstats_passes.h \
              lightning_hooks/output/_crc32c_native.c; do
    grep -q "/$needed\$" <<<"$listing" || { echo "package_check: $needed is missing from the sdist"; exit 1; }
done
if grep -E '\.(so|pyd)$' <<<"$listing"; then echo "package_check: a compiled file is in the sdist"; exit 1; fi

# The wheel in a fresh venv, used from outside the repository.
"$python" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q torch==2.13.0
"$work/venv/bin/python" -m pip install -q "${wheel[0]}"
installed="$("$work/venv/bin/python" -m pip show -f lightning-hooks)"
grep -q "licenses/LICENSE" <<<"$installed" || { echo "package_check: the wheel has no LICENSE"; exit 1; }
grep -q "License-Expression: Apache-2.0" "$work"/venv/lib/python*/site-packages/lightning_hooks-*.dist-info/METADATA \
    || { echo "package_check: the wheel's metadata has no SPDX license"; exit 1; }
cd "$work"
"$work/venv/bin/python" -m lightning_hooks
"$work/venv/bin/python" -c "from lightning_hooks.measure import stats; assert stats.NATIVE_KERNEL, 'the wheel has no C kernel'"
"$work/venv/bin/python" "$repo/examples/quickstart.py" "$work/runs" >"$work/quickstart.out" 2>"$work/quickstart.log" \
    || { tail -40 "$work/quickstart.log"; exit 1; }
tail -n 7 "$work/quickstart.out"  # its figures (the progress bar, on stdout too, comes before)
grep -q "Hooks left on the model after fit: 0" "$work/quickstart.out"
# The Layers tab: TensorBoard finds the plugin by its entry point, and its ES module and CSS are in the wheel.
"$work/venv/bin/python" -c "
from importlib.metadata import entry_points
from importlib.resources import files
(found,) = [e for e in entry_points(group='tensorboard_plugins') if e.name == 'lightning_hooks_layers']
plugin = found.load()
static = files(plugin.__module__.rpartition('.')[0]) / 'static'
assert (static / 'index.js').is_file() and (static / 'style.css').is_file(), 'the Layers tab has no static files'
"

# The unpacked sdist's own tests import their helpers: one file of them, against the installed wheel.
tar -xzf "${sdist[0]}" -C "$work"
cd "$work"/lightning_hooks-*/
"$work/venv/bin/python" -m pip install -q "pytest>=8"
rm -rf lightning_hooks  # the installed wheel, not the sources, is what is tested
"$work/venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_selection.py
echo "package_check: OK"
