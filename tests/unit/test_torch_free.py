"""The pure parts are tested without torch: the scheduler, block pool and KV manager, the
stop-string logic and every placement policy but the expert balancer (moed.balance.experts
works on tensors, as EPLB's pure functions do). Their tests run here in a child pytest where
`import torch` fails, so a torch import sneaking into them (or into the code) is caught."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TORCH_FREE = ["tests/unit/engine/test_scheduler.py", "tests/unit/engine/test_scheduler_property.py",
              "tests/unit/engine/test_stop.py", "tests/unit/kvcache", "tests/unit/balance",
              "tests/unit/cluster/test_cluster_policy.py", "tests/unit/parallel/test_ep_layout.py",
              "--ignore=tests/unit/balance/test_experts.py"]

# sys.modules["torch"] = None makes every `import torch` raise ImportError, as if uninstalled.
_RUN = ("import sys; sys.modules['torch'] = None; import pytest; "
        "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', *sys.argv[1:]]))")


def test_pure_tests_pass_without_torch() -> None:
    r = subprocess.run([sys.executable, "-c", _RUN, *TORCH_FREE], cwd=ROOT, timeout=240,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    passed = re.search(r"(\d+) passed", r.stdout)
    assert passed and int(passed.group(1)) >= 40, r.stdout[-2000:]
    assert "skipped" not in r.stdout, r.stdout[-2000:]
