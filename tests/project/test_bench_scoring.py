"""``python -m bench.scoring --quick`` runs every section it keeps in quick mode (the long-prompt rows and the
dtype comparison) and ends with their target lines; its figures are not the targets'."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_scoring_bench_quick_mode_prints_its_tables_and_target_lines():
    out = subprocess.run([sys.executable, "-m", "bench.scoring", "--quick"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode in (0, 1), out.stderr  # 1: a target failed at quick sizes, not a crash
    text = out.stdout
    assert "long prompts, shipped draft-tiny" in text and "| peak ratio |" in text
    assert "|   2048 |" in text and "| 4-bit dequantized to float32 |" in text
    assert "target cpu_float32_over_bf16_prefill:" in text
