"""Issue 16, finding 9: --keep's reach is visible: every option's help says what it does and
its default (no RST markup), and a result says when keep had no effect and why."""
from __future__ import annotations

import json
import re

import pytest

from tests.support.cli_procs import cli, service  # noqa: F401

COMMANDS = ["worker", "submit", "watch", "status", "result", "cancel", "list", "batch", "generate",
            "cache", "serve", "demo"]
WORDS = "the and her in that it not be as for".split()  # one token each (shipped BPE)


def option_blocks(help_text: str) -> dict[str, str]:
    """Each option's help block from ``--help`` output, by its first flag."""
    blocks: dict[str, str] = {}
    current = None
    section = help_text.split("\noptions:\n", 1)[1].split("\nexit status", 1)[0]
    for line in section.splitlines():
        m = re.match(r"^  (?:-\w, )?(--[\w-]+)", line)
        if m:
            current = m.group(1)
            blocks[current] = line
        elif current and line.startswith("    "):
            blocks[current] += " " + line.strip()
    return blocks


@pytest.mark.parametrize("command", COMMANDS)
def test_finding9_every_option_has_a_sentence_and_its_default(command):
    res = cli(command, "--help")
    assert res.returncode == 0, res
    assert "``" not in res.stdout and ":class:" not in res.stdout
    blocks = option_blocks(res.stdout)
    assert "--redis-url" in blocks
    for flag, block in blocks.items():
        if flag == "--help":
            continue
        words = block.split(None, 1)[1] if len(block.split(None, 1)) > 1 else ""
        assert "default" in block or "(required)" in block, f"{command} {flag}: {block}"
        assert len(re.findall(r"[a-z]{3,}", words)) >= 3, f"{command} {flag} says nothing: {block}"


def test_finding9_keep_threshold_and_tail_are_explained_together():
    blocks = option_blocks(cli("submit", "--help").stdout)
    assert "--threshold" in blocks["--keep"] and "--tail-tokens" in blocks["--keep"]
    assert "(default: 0.2" in blocks["--keep"] and "8192" in blocks["--threshold"]
    assert "512" in blocks["--tail-tokens"]


def _submit(service, n_tokens, *opts):
    prompt = " ".join(WORDS[i % len(WORDS)] for i in range(n_tokens))
    res = cli("submit", "--text", prompt, "--wait", "--json", "--redis-url", service.url, *opts)
    assert res.returncode == 0, res
    return json.loads(res.stdout)


def test_finding9_a_result_says_when_keep_had_no_effect(service):
    below = _submit(service, 3006, "--keep", "0.2")  # the default threshold is 8192
    assert below["kept"] == below["total"] == 3006
    assert "no effect" in below["keep_effect"] and "threshold of 8192" in below["keep_effect"]

    tail = _submit(service, 3006, "--keep", "0.0001", "--threshold", "0")
    assert tail["kept"] > 0.1 * tail["total"]  # the 512-token tail, not 0.01 %
    assert "512-token tail" in tail["keep_effect"] and "keep 0.0001" in tail["keep_effect"]

    sparse = _submit(service, 3006, "--keep", "0.2", "--threshold", "0", "--tail-tokens", "64")
    assert sparse["kept"] < 0.3 * sparse["total"] and sparse["keep_effect"] is None

    text = cli("submit", "--text", " ".join(WORDS * 300), "--wait", "--redis-url", service.url)
    assert "keep had no effect" in text.stdout and "--threshold" in text.stdout
