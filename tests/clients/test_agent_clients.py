"""Claude Code, Codex CLI and Qwen Code, configured as their docs say, against ``specprefill
serve`` on the shipped models (issue 40 item 8): a turn and a continued turn each, every request
answered 2xx (the server's access log), the reply printed, exit 0, and the second turn restoring
the first (the job results' ``target_tokens``).

The clients run non-interactively with their telemetry, update checks and background model
calls off. In the default suite each uses its own documented switches that shrink the prompt it
sends (Claude Code ``--bare``; Codex a short ``model_instructions_file`` and its multi-agent,
goals, apps and web-search tools off; Qwen Code ``--bare``, ``--system-prompt`` and all tools
but ``read_file`` excluded), so a turn prefills 1-4 thousand tokens on a CPU, not 12-27
thousand; the requests keep their real shape (system blocks, tools, streaming, the clients' own
fields). The ``full`` cases (opt-in, ``--soak``) send each client's whole default prompt.

What each run did (requests with their status, the turns' restored counts, the clients'
output) is written to ``test-artifacts/clients/<client>.json``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from jobs.settings import SHIPPED_MODELS, Settings
from tests.clients.conftest import (API_KEY, CLIENT_TIMEOUT_S, MODEL, ROOT, Run, Served, client_env, client_path,
                                    run_client)

ARTIFACTS = ROOT / "test-artifacts" / "clients"
FIRST, SECOND = "Say hello.", "What is 2+2?"
SIZES = ["small", pytest.param("full", marks=pytest.mark.soak)]


@dataclass
class Turn:
    run: Run
    requests: list[dict[str, Any]]
    results: list[dict[str, Any]]  # the generate jobs this turn ran, oldest first
    heal_wait_s: float

    @property
    def answer(self) -> dict[str, Any]:
        """The turn's last job: the answer the client printed."""
        assert self.results, f"no generate job ran for this turn\n{self.run.explain()}"
        return self.results[-1]

    @property
    def opening(self) -> dict[str, Any]:
        """The turn's first job: the conversation so far and the new message (a client may go on
        within the turn: a tool result, or a "continue" after a reply cut at its token limit)."""
        assert self.results, f"no generate job ran for this turn\n{self.run.explain()}"
        return self.results[0]


def two_turns(served: Served, argvs: list[list[str]], env: dict[str, str], cwd: Path,
              size: str = "small") -> list[Turn]:
    """Run each client invocation in turn; after each, wait for its heal (as a person reading
    the answer would) so the next turn finds the conversation stored. A full prompt's cold turn
    and heal take minutes on a CPU."""
    turns, patience = [], 1 if size == "small" else 5
    for argv in argvs:
        mark, before = served.mark(), len(served.generate_results())
        run = run_client(argv, env, cwd, timeout=CLIENT_TIMEOUT_S * patience)
        waited = served.wait_for_heals(timeout=240 * patience)
        turns.append(Turn(run, served.requests(mark), served.generate_results()[before:], waited))
    return turns


def record(name: str, turns: list[Turn], figures: dict[str, int] | None = None) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    out = [{"argv": t.run.argv, "returncode": t.run.returncode, "seconds": round(t.run.seconds, 1),
            "heal_wait_s": round(t.heal_wait_s, 1), "stdout": t.run.stdout[-4000:], "stderr": t.run.stderr[-4000:],
            "requests": [r.get("message") for r in t.requests],
            "jobs": [{k: r.get(k) for k in ("job_id", "total", "kept", "target_tokens", "finish_reason", "text",
                                             "ttft_s", "heal", "reason")} for r in t.results]}
           for t in turns]
    (ARTIFACTS / f"{name}.json").write_text(json.dumps({"turn2": figures, "turns": out}, indent=1))


def status_of(request: dict[str, Any]) -> int:
    """The status code an access-log line names (uvicorn's ``... "POST /path HTTP/1.1" 200``)."""
    return int(request["message"].rstrip().rsplit(" ", 1)[-1])


def check(served: Served, name: str, turns: list[Turn], min_restored_share: float | None = None) -> dict[str, int]:
    """Every request 2xx, each turn exits 0 with its reply printed, turn 2 restores turn 1 (what
    it restored is added to the record)."""
    record(name, turns)
    for i, t in enumerate(turns, 1):
        bad = [r["message"] for r in t.requests if not 200 <= status_of(r) < 300]
        assert not bad, f"turn {i}: requests not answered 2xx: {bad}\n{t.run.explain()}"
        assert t.requests, f"turn {i}: the client made no request\n{t.run.explain()}"
        assert t.run.returncode == 0, f"turn {i}:\n{t.run.explain()}"
        said = t.answer["text"].strip()[:40]
        shown = (said, json.dumps(said, ensure_ascii=False)[1:-1])  # as text, or inside stream-json
        assert said and any(s in t.run.stdout for s in shown), t.run.explain()
    one, two = turns[0].answer, turns[1].opening
    restored, total = two["target_tokens"]["restored"], two["total"]
    # The first turn whole (its prompt, answer and end of turn, as its heal stored them), as far
    # as the second turn's request repeats it: a client may rewrite its history (Qwen Code moves
    # its date reminder from the first user message to the newest), and a prefix cache can give
    # back only what comes before the first change, in whole blocks (stored tails end prefixes).
    assert one["heal"].get("queued"), one["heal"]
    stored, repeated = repeated_prefix(served.redis_url, one, two)
    block = Settings().block_size
    figures = {"restored": restored, "total": total, "turn1_stored": len(stored), "repeated": repeated}
    record(name, turns, figures)
    expected = len(stored) if repeated == len(stored) else repeated // block * block
    assert restored >= expected, figures
    if min_restored_share is not None:
        assert restored / total >= min_restored_share, figures
    return figures


def job_payload(job_id: str, redis_url: str) -> dict[str, Any]:
    import redis
    from rq.job import Job
    from rq.serializers import JSONSerializer

    return Job.fetch(job_id, connection=redis.Redis.from_url(redis_url), serializer=JSONSerializer).args[0]


def repeated_prefix(redis_url: str, one: dict[str, Any], two: dict[str, Any]) -> tuple[list[int], int]:
    """Turn 1's stored conversation (its heal's tokens) and how many of its leading tokens turn 2's
    prompt (tokenized as the worker does) repeats."""
    from jobs.contract.spec import spec_from_payload
    from tests.support.chat_folders import load_tokenizer
    from worker.job.prompt import _common_prefix_len, tokenize_prompt

    stored = job_payload(one["heal"]["job_id"], redis_url)["tokens"]
    spec = spec_from_payload(job_payload(two["job_id"], redis_url), Settings())
    prompt = tokenize_prompt(spec, load_tokenizer(SHIPPED_MODELS / "target-tiny")).tokens
    return stored, _common_prefix_len(stored, prompt)


@pytest.mark.parametrize("size", SIZES)
def test_claude_code_answers_and_continues(served, tmp_path, size):
    claude = str(client_path("claude"))
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    env = client_env(home, ANTHROPIC_BASE_URL=served.url, ANTHROPIC_API_KEY=API_KEY,
                     DISABLE_AUTOUPDATER="1", DISABLE_TELEMETRY="1", DISABLE_ERROR_REPORTING="1",
                     CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_NON_ESSENTIAL_MODEL_CALLS="1",
                     ANTHROPIC_DEFAULT_HAIKU_MODEL=MODEL, CLAUDE_CODE_MAX_OUTPUT_TOKENS="64")
    flags = ["--model", MODEL, *(["--bare"] if size == "small" else [])]
    turns = two_turns(served, [[claude, "-p", FIRST, *flags],
                               [claude, "-p", SECOND, "--continue", "--output-format", "stream-json", "--verbose",
                                *flags]], env, work, size)
    check(served, f"claude-code-{size}", turns, min_restored_share=0.99)
    events = [json.loads(line) for line in turns[1].run.stdout.splitlines() if line.startswith("{")]
    result = [e for e in events if e.get("type") == "result"]
    assert result and not result[-1].get("is_error"), turns[1].run.explain()
    usage = result[-1].get("usage", {})  # the turn's requests added up
    assert usage.get("cache_read_input_tokens") == sum(r["target_tokens"]["restored"] for r in turns[1].results), usage


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


@pytest.mark.parametrize("size", SIZES)
def test_codex_exec_answers_and_resumes(served, tmp_path, size):
    codex = str(client_path("codex"))
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    env = client_env(home, CODEX_HOME=str(codex_home(home, served.url)), SPECPREFILL_TEST_API_KEY=API_KEY)
    flags = ["--skip-git-repo-check"]
    if size == "small":
        instructions = home / "instructions.md"
        instructions.write_text("You are Codex, a coding agent in a terminal. Answer briefly.\n")
        flags += ["--disable", "multi_agent", "--disable", "goals", "--disable", "apps", "-c", 'web_search="disabled"',
                  "-c", f'model_instructions_file="{instructions}"']
    turns = two_turns(served, [[codex, "exec", *flags, FIRST],
                               [codex, "exec", *flags, "resume", "--last", SECOND]], env, work, size)
    check(served, f"codex-{size}", turns)


@pytest.mark.parametrize("size", SIZES)
def test_qwen_code_answers_and_continues(served, tmp_path, size):
    qwen = str(client_path("qwen"))
    home, work = tmp_path / "home", tmp_path / "work"
    (home / ".qwen").mkdir(parents=True), work.mkdir()
    (home / ".qwen" / "settings.json").write_text(json.dumps({
        "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
        "privacy": {"usageStatisticsEnabled": False}, "telemetry": {"enabled": False}}))
    env = client_env(home, OPENAI_BASE_URL=served.url + "/v1", OPENAI_API_KEY=API_KEY, OPENAI_MODEL=MODEL,
                     QWEN_TELEMETRY_ENABLED="false")
    flags = ["--bare", "--system-prompt", "You are Qwen Code, a coding agent in a terminal. Answer briefly.",
             "--exclude-tools", "run_shell_command,edit,notebook_edit,update_goal,get_goal"] if size == "small" else []
    turns = two_turns(served, [[qwen, *flags, "-p", FIRST], [qwen, *flags, "--continue", "-p", SECOND]], env, work,
                      size)
    check(served, f"qwen-code-{size}", turns)
