"""Claude Code, Codex CLI and Qwen Code, configured as their docs say, against ``specprefill
serve`` on the shipped models (issue 40 item 8): a turn and a continued turn each, every request
answered 2xx (the server's access log), the reply printed, exit 0, and the second turn restoring
the first (the job results' ``target_tokens``).

The clients run non-interactively with their telemetry, update checks and background model
calls off. Each uses its own documented switch that shrinks the prompt it sends (Claude Code
``--bare``, Codex's tool features off, Qwen Code ``--bare`` with its tools but one excluded),
so the default suite prefills a few thousand tokens per turn on a CPU, not 12-27 thousand;
the requests keep their real shape (system blocks, tools, streaming, the clients' own fields).

What each run did (requests with their status, the turns' restored counts, the clients'
output) is written to ``test-artifacts/clients/<client>.json``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.clients.conftest import API_KEY, MODEL, ROOT, Run, Served, client_env, client_path, run_client

ARTIFACTS = ROOT / "test-artifacts" / "clients"
FIRST, SECOND = "Say hello.", "What is 2+2?"


@dataclass
class Turn:
    run: Run
    requests: list[dict[str, Any]]
    results: list[dict[str, Any]]  # the generate jobs this turn ran, oldest first
    heal_wait_s: float

    @property
    def answer(self) -> dict[str, Any]:
        assert self.results, f"no generate job ran for this turn\n{self.run.explain()}"
        return self.results[-1]


def two_turns(served: Served, argvs: list[list[str]], env: dict[str, str], cwd: Path) -> list[Turn]:
    """Run each client invocation in turn; after each, wait for its heal (as a person reading
    the answer would) so the next turn finds the conversation stored."""
    turns = []
    for argv in argvs:
        mark, before = served.mark(), len(served.generate_results())
        run = run_client(argv, env, cwd)
        waited = served.wait_for_heals()
        turns.append(Turn(run, served.requests(mark), served.generate_results()[before:], waited))
    return turns


def record(name: str, turns: list[Turn]) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    out = [{"argv": t.run.argv, "returncode": t.run.returncode, "seconds": round(t.run.seconds, 1),
            "heal_wait_s": round(t.heal_wait_s, 1), "stdout": t.run.stdout[-4000:], "stderr": t.run.stderr[-4000:],
            "requests": [r.get("message") for r in t.requests],
            "jobs": [{k: r.get(k) for k in ("job_id", "total", "kept", "target_tokens", "finish_reason", "text",
                                             "ttft_s", "heal", "reason")} for r in t.results]}
           for t in turns]
    (ARTIFACTS / f"{name}.json").write_text(json.dumps(out, indent=1))


def status_of(request: dict[str, Any]) -> int:
    """The status code an access-log line names (uvicorn's ``... "POST /path HTTP/1.1" 200``)."""
    return int(request["message"].rstrip().rsplit(" ", 1)[-1])


def check(turns: list[Turn], min_restored_share: float | None = None) -> None:
    """Every request 2xx, each turn exits 0 with its reply printed, turn 2 restores turn 1."""
    for i, t in enumerate(turns, 1):
        bad = [r["message"] for r in t.requests if not 200 <= status_of(r) < 300]
        assert not bad, f"turn {i}: requests not answered 2xx: {bad}\n{t.run.explain()}"
        assert t.requests, f"turn {i}: the client made no request\n{t.run.explain()}"
        assert t.run.returncode == 0, f"turn {i}:\n{t.run.explain()}"
        assert t.answer["text"].strip() and t.answer["text"].strip()[:40] in t.run.stdout, t.run.explain()
    one, two = turns[0].answer, turns[1].answer
    restored, total = two["target_tokens"]["restored"], two["total"]
    # The first turn whole (its prompt, answer and end of turn, as its heal stored them).
    assert one["heal"].get("queued") or "nothing to heal" in one["heal"].get("reason", ""), one["heal"]
    assert restored >= one["heal"]["tokens"], (restored, total, one["heal"])
    if min_restored_share is not None:
        assert restored / total >= min_restored_share, (restored, total)


def test_claude_code_answers_and_continues(served, tmp_path):
    claude = str(client_path("claude"))
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    env = client_env(home, ANTHROPIC_BASE_URL=served.url, ANTHROPIC_API_KEY=API_KEY,
                     DISABLE_AUTOUPDATER="1", DISABLE_TELEMETRY="1", DISABLE_ERROR_REPORTING="1",
                     CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_NON_ESSENTIAL_MODEL_CALLS="1",
                     ANTHROPIC_DEFAULT_HAIKU_MODEL=MODEL, CLAUDE_CODE_MAX_OUTPUT_TOKENS="64")
    flags = ["--model", MODEL, "--bare"]
    turns = two_turns(served, [[claude, "-p", FIRST, *flags],
                               [claude, "-p", SECOND, "--continue", "--output-format", "stream-json", "--verbose",
                                *flags]], env, work)
    record("claude-code", turns)
    check(turns, min_restored_share=0.99)
    events = [json.loads(line) for line in turns[1].run.stdout.splitlines() if line.startswith("{")]
    result = [e for e in events if e.get("type") == "result"]
    assert result and not result[-1].get("is_error"), turns[1].run.explain()
    usage = result[-1].get("usage", {})
    assert usage.get("cache_read_input_tokens") == turns[1].answer["target_tokens"]["restored"], usage


def codex_home(home: Path, url: str) -> Path:
    """A CODEX_HOME whose config.toml names the server as a ``responses`` provider."""
    codex = home / ".codex"
    codex.mkdir(parents=True)
    (codex / "config.toml").write_text(f'''model = "{MODEL}"
model_provider = "specprefill"
check_for_update_on_startup = false

[model_providers.specprefill]
name = "specprefill"
base_url = "{url}/v1"
env_key = "SPECPREFILL_TEST_API_KEY"
wire_api = "responses"

[analytics]
enabled = false

[otel]
exporter = "none"
''')
    return codex


def test_codex_exec_answers_and_resumes(served, tmp_path):
    codex = str(client_path("codex"))
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    env = client_env(home, CODEX_HOME=str(codex_home(home, served.url)), SPECPREFILL_TEST_API_KEY=API_KEY)
    flags = ["--skip-git-repo-check"]
    turns = two_turns(served, [[codex, "exec", *flags, FIRST],
                               [codex, "exec", *flags, "resume", "--last", SECOND]], env, work)
    record("codex", turns)
    check(turns)


def test_qwen_code_answers_and_continues(served, tmp_path):
    qwen = str(client_path("qwen"))
    home, work = tmp_path / "home", tmp_path / "work"
    (home / ".qwen").mkdir(parents=True), work.mkdir()
    (home / ".qwen" / "settings.json").write_text(json.dumps({
        "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
        "privacy": {"usageStatisticsEnabled": False}, "telemetry": {"enabled": False}}))
    env = client_env(home, OPENAI_BASE_URL=served.url + "/v1", OPENAI_API_KEY=API_KEY, OPENAI_MODEL=MODEL,
                     QWEN_TELEMETRY_ENABLED="false")
    flags = ["--bare", "--exclude-tools", "run_shell_command,edit,notebook_edit,update_goal,get_goal"]
    turns = two_turns(served, [[qwen, *flags, "-p", FIRST], [qwen, *flags, "--continue", "-p", SECOND]], env, work)
    record("qwen-code", turns)
    check(turns)
