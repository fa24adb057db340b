#!/usr/bin/env bash
# The worked sweep example of docs/sweeps.md: Fast-dLLM threshold x block length on the embedded model's task mix.
# Runs `dlm -m +sweep=threshold_grid` on 200 held-out prompts, then copies the table and the plots to docs/.
#   experiments/sweep_example.sh                                   # the default (embedded) model
#   experiments/sweep_example.sh model=local model.path=DIR        # any other checkpoint
# A re-run with the same SWEEP_DIR resumes (finished jobs are skipped); delete it to start over.
set -euo pipefail
cd "$(dirname "$0")/.."
DLM=${DLM:-$( [ -x .venv/bin/dlm ] && echo .venv/bin/dlm || echo dlm )}
SWEEP_DIR=${SWEEP_DIR:-multirun/readme_threshold_grid}
"$DLM" -m +sweep=threshold_grid task=tiny_mix task.n=200 trace.record=false \
    print_outputs=false hydra.sweep.dir="$SWEEP_DIR" "$@"
mkdir -p docs
cp "$SWEEP_DIR/sweep.md" docs/sweep_example.md
cp "$SWEEP_DIR/accuracy_vs_nfe.png" docs/sweep_accuracy_vs_nfe.png
cp "$SWEEP_DIR/tps.png" docs/sweep_tps.png
chmod 644 docs/sweep_example.md docs/sweep_accuracy_vs_nfe.png docs/sweep_tps.png
echo "updated docs/sweep_example.md docs/sweep_accuracy_vs_nfe.png docs/sweep_tps.png"
