#!/usr/bin/env bash
# The one accelerator check (issue 43; benchmarks/device_check.py says what it measures). One run, at most 8 minutes
# on one H200, no network: JSON + markdown to $OUT, else benchmarks/results/device/.
#
#   benchmarks/device_check.sh             # on the GPU machine (its image's python3: jax with CUDA, flax, ...)
#   benchmarks/device_check.sh --dry-run   # the same code on this CPU at small sizes, the GPU programs lowered
#                                          # for CUDA; what tests/test_device_check.py runs in CI
#
# Missing packages (fastapi, uvicorn and theirs, for the serve part) travel as wheels in .whl/ (ignored; see
# docs/performance.md): they are installed to a temporary folder, never from a registry. The project itself is
# installed with `pip install --no-deps --no-index` (editable, so the bundled pair in assets/ is found); the dry
# run only checks that this install would work (pip --dry-run), leaving the environment as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
DRY=0
for arg in "$@"; do [[ "$arg" == --dry-run ]] && DRY=1; done
export PYTHONUNBUFFERED=1
export PYTHONPATH="${PWD}${PYTHONPATH:+:$PYTHONPATH}"

if [[ -d .whl ]] && compgen -G ".whl/*.whl" > /dev/null; then
    site="$(mktemp -d)"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl \
        && export PYTHONPATH="${PYTHONPATH}:${site}" || echo "device_check: installing .whl/*.whl failed" >&2
fi
install=(-m pip install -q --no-deps --no-index --no-build-isolation -e .)
if [[ $DRY == 1 ]]; then
    export PJRT_NPROC="${PJRT_NPROC:-32}" JAX_PLATFORMS=cpu  # see sharding/cpu.py
    "$PYTHON" "${install[@]:0:3}" --dry-run "${install[@]:3}" > /dev/null && JAXSPEC_INSTALL="pip --dry-run: ok" \
        || JAXSPEC_INSTALL="pip --dry-run: FAILED"
    limit=300
else
    "$PYTHON" "${install[@]}" && JAXSPEC_INSTALL="pip install --no-deps -e .: ok" \
        || JAXSPEC_INSTALL="pip install --no-deps -e . FAILED (running from PYTHONPATH)"
    limit=490  # the script's own budget is 460 s; this is the backstop
fi
export JAXSPEC_INSTALL
exec timeout "$limit" "$PYTHON" benchmarks/device_check.py "$@"
