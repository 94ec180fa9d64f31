#!/usr/bin/env bash
# Device check for issue 16 (one accelerator, under 10 minutes): tree drafts vs chain drafts on the bundled pair,
# tokens/s and accepted length per configuration plus the verify step's cost against the number of tokens verified
# (benchmarks/tree_vs_chain.py). On the 2-core CPU a verify of T tokens costs ~T/2..T decode steps (each token hits
# its own experts and XLA:CPU runs them one tile at a time), so extra tree nodes cost nearly what they save; on an
# accelerator a small verify is launch- and bandwidth-bound and nearly flat in T, which is where trees are expected
# to pay. This script measures that on the device.
#
#   benchmarks/device_check_tree.sh             # on the device machine; JSON + markdown to $OUT or results/
#   benchmarks/device_check_tree.sh --prompts 2 --repeats 1 --max-new-tokens 16   # a quick run (also on CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="${PWD}${PYTHONPATH:+:$PYTHONPATH}"
OUT_DIR="${OUT:-benchmarks/results}"
exec timeout 570 python benchmarks/tree_vs_chain.py --output "$OUT_DIR/tree_vs_chain_device.json" "$@"
