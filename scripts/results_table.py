"""Print a markdown table of the metrics.json files of the given run directories."""

import json
import sys
from pathlib import Path

KEYS = ("accuracy", "nll", "ece", "aece", "brier", "train_time_s")

print("| run | method | " + " | ".join(KEYS) + " |")
print("|---|---|" + "---:|" * len(KEYS))
for run in sys.argv[1:]:
    m = json.loads((Path(run) / "metrics.json").read_text())
    print(f"| {Path(run).name} | {m['method']} | " + " | ".join(f"{m[k]:.4f}" for k in KEYS) + " |")
