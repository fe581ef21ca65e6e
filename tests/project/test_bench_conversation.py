"""bench/conversation.py --quick runs end to end (the bench smoke test): the four ways through the
conversation, the user job behind heals on a real worker, and its three target lines. Recall is
deterministic (greedy answers on the shipped models), so the heal must recall what a full
prefill recalls; the timing targets are only required to be measured (noisy on shared CPUs)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_conversation_bench_quick():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECPREFILL_") and k != "REDIS_URL"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "conversation.py"), "--quick"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    targets = dict(re.findall(r"^target (\w+): (.*)$", proc.stdout, re.M))
    assert set(targets) == {"heal_turn_ttft_vs_plain", "heal_late_recall", "heal_user_job_delay"}, proc.stdout
    assert targets["heal_late_recall"].endswith("PASS"), proc.stdout
    assert "| 10 | heal |" in proc.stdout and "| 10 | sparse |" in proc.stdout
