"""Which environment variable changes torch's CPU kernels on this machine: the bits of small results under each.

Runs one child process per setting (torch reads the variables when it starts) and prints, for a matrix product
(MKL), a convolution and a depthwise convolution (oneDNN), a log-softmax, a sum and an exponential (ATen's
vectorized kernels), a BatchNorm and the random draws, a short hash of the result's bytes: a hash that differs
from the first row's means the setting changed that kernel here. ``python scripts/isa_kernels.py``
(docs/studies/demo.md quotes its output).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

SETTINGS = (
    {},
    {"ATEN_CPU_CAPABILITY": "avx2"},
    {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    {"ATEN_CPU_CAPABILITY": "default"},
)

CHILD = """
import hashlib, json, torch, torch.nn.functional as F
def h(t): return hashlib.sha1(t.detach().contiguous().numpy().tobytes()).hexdigest()[:8]
torch.manual_seed(0)
a, b = torch.randn(257, 513), torch.randn(513, 129)
x, w, dw = torch.randn(8, 32, 24, 24), torch.randn(64, 32, 3, 3), torch.randn(32, 1, 3, 3)
torch.manual_seed(1)
print(json.dumps({
    "capability": torch.backends.cpu.get_cpu_capability(),
    "matmul": h(a @ b), "conv": h(F.conv2d(x, w, padding=1)), "depthwise": h(F.conv2d(x, dw, padding=1, groups=32)),
    "log_softmax": h(torch.log_softmax(a, 1)), "sum": h(a.sum(1)), "exp": h(torch.exp(a)),
    "batch_norm": h(F.batch_norm(x, None, None, training=True)), "randn": h(torch.randn(1000)),
}))
"""


def main() -> None:
    """Print, per setting, torch's capability and the kernels whose bits differ from the first setting's."""
    rows = []
    for setting in SETTINGS:
        env = {k: v for k, v in os.environ.items() if k not in SETTINGS[-2]} | setting
        done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
        rows.append((setting, json.loads(done.stdout)))
    base = rows[0][1]
    for setting, row in rows:
        changed = [k for k in row if k != "capability" and row[k] != base[k]]
        name = " ".join(f"{k}={v}" for k, v in setting.items()) or "(none)"
        print(f"{name:78s} {row['capability']:8s} changed: {', '.join(changed) or 'nothing'}")


if __name__ == "__main__":
    main()
