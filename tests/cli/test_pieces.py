"""CLI pieces in-process (the demo end to end is in test_cli_demo.py)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis

from specprefill_cli.app import build_parser
from specprefill_cli.demo import load_demo
from specprefill_cli.documents import iter_documents
from specprefill_cli.main import main
from specprefill_cli.options import prompt_fields, selection_fields
from jobs.connection import safe_url

ROOT = Path(__file__).resolve().parents[2]


def test_every_command_takes_redis_url():
    p = build_parser()
    for argv in (["worker"], ["submit", "--text", "x"], ["watch", "j"], ["batch", "f", "--out", "o"],
                 ["cache", "stats"], ["demo"]):
        assert p.parse_args(argv + ["--redis-url", "rediss://:pw@h:1/0"]).redis_url == "rediss://:pw@h:1/0"


def test_password_is_masked_in_messages():
    assert safe_url("rediss://:s3cret@host:6380/0") == "rediss://:***@host:6380/0"
    assert safe_url("redis://user:s3cret@host/0") == "redis://user:***@host/0"


def test_missing_url_and_bad_spec_are_clean_errors(capsys, monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("SPECPREFILL_REDIS_URL", raising=False)
    assert main(["submit", "--text", "x"]) == 2
    assert "no Redis URL" in capsys.readouterr().err


def test_bad_spec_fails_before_enqueue(redis_url, capsys):
    assert main(["submit", "--redis-url", redis_url, "--text", "x", "--keep", "3"]) == 2
    assert "keep: 3.0 is outside" in capsys.readouterr().err


def test_generate_seed_seeds_the_draft_and_the_sampling(redis_url, capsys):
    from jobs.client import Client

    assert main(["generate", "--redis-url", redis_url, "--text", "x y", "--seed", "3", "--json"]) == 0
    job_id = json.loads(capsys.readouterr().out)["job_id"]
    payload = Client.from_url(redis_url).handle(job_id)._job().args[0]
    assert payload["scoring"]["seed"] == 3 and payload["generate"]["seed"] == 3


@pytest.mark.parametrize("argv", [["submit", "--text", "x", "--wait"], ["submit", "--text", "x", "--wait", "--json"],
                                  ["generate", "--text", "x", "--stream"], ["generate", "--text", "x", "--wait"]])
def test_timeout_is_a_clean_error(redis_url, capsys, argv):
    started = time.monotonic()
    assert main([*argv, "--redis-url", redis_url, "--timeout", "0.5"]) == 4  # no worker runs
    assert time.monotonic() - started < 5
    err = capsys.readouterr().err
    assert "--timeout:" in err and "keeps running" in err and "Traceback" not in err


def test_batch_errors_name_the_file_or_document(redis_url, capsys, tmp_path):
    bad_bytes = tmp_path / "latin1.txt"
    bad_bytes.write_bytes(b"\xff\xfe caf\xe9")
    assert main(["batch", str(bad_bytes), "--out", str(tmp_path / "o.jsonl"), "--redis-url", redis_url]) == 2
    assert f"{bad_bytes}: not UTF-8 text" in capsys.readouterr().err
    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"text": "bad", "keep": 7}\n{"id": "d3", "txt": "typo"}\n{"id": "d4", "text": " "}\n')
    assert main(["batch", str(docs), "--out", str(tmp_path / "o.jsonl"), "--redis-url", redis_url]) == 2
    err = capsys.readouterr().err
    assert f"document {docs}:1: keep: 7" in err
    assert "document d3: no text, tokens or messages (its other fields: txt)" in err
    assert "document d4: empty text" in err
    assert redis.Redis.from_url(redis_url).keys("rq:job:*") == []  # nothing enqueued
    lines = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert [x["status"] for x in lines] == ["rejected"] * 4  # each said why, once


def test_worker_preload_flag_is_admitted_by_the_allow_list(monkeypatch):
    import fakeredis

    import worker.process.launcher as launcher
    import worker.process.rq_worker as rq_worker
    from jobs.contract.spec import Limits

    seen = {}
    monkeypatch.setenv("SPECPREFILL_ALLOWED_MODELS", "org/other")
    monkeypatch.setattr(launcher, "checked_connection", lambda url, settings: fakeredis.FakeRedis())
    monkeypatch.setattr(rq_worker, "run_worker",
                        lambda runtime, queues, **kw: seen.update(settings=runtime.settings, **kw))
    assert main(["worker", "--preload", "org/preloaded", "--redis-url", "redis://unused"]) == 0
    assert seen["preload"] == ("org/preloaded",)
    Limits.from_settings(seen["settings"]).check_model("org/preloaded", "draft_model")  # no error


def test_generate_stream_shows_the_final_text_when_a_retry_diverged(monkeypatch, capsys):
    import fakeredis

    import specprefill_cli.options as options
    import jobs.client.client as client_mod
    from jobs.contract.results import GenerateResult

    final = GenerateResult(job_id="j", text="abXY", finish_reason="length", token_ids=[1, 2],
                           ttft_s=0.1, kept=4, total=4)

    class Handle:
        id, created = "j", True

        def stream_text(self, timeout=None):
            yield "abcd"
            raise client_mod.StreamDiverged("job j: a retry generated other text from character 2 on")

        def result(self, timeout=None):
            return final

    class FakeClient:
        def __init__(self, *a, **k):
            from types import SimpleNamespace

            self.connection, self.queue = fakeredis.FakeRedis(), SimpleNamespace(name="q")

        def generate_spec(self, **fields):
            return fields

        def submit(self, spec, holder=None):
            return Handle()

    monkeypatch.setattr(options, "checked_connection", lambda url, settings: fakeredis.FakeRedis())
    monkeypatch.setattr(client_mod, "Client", FakeClient)
    assert main(["generate", "--text", "q", "--stream", "--redis-url", "redis://unused"]) == 0
    out = capsys.readouterr()
    assert out.out == "abcd\nabXY\n" and "a retry generated other text" in out.err


def test_auth_url_is_honoured(capsys):
    from specprefill_cli.embedded_redis import EmbeddedRedis

    with EmbeddedRedis(password="pw1") as server:
        assert main(["cache", "stats", "--redis-url", server.url, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["blocks"] == 0
        bad = server.url.replace("pw1", "nope")
        assert main(["cache", "stats", "--redis-url", bad]) == 3  # Redis unreachable
        assert "***" in capsys.readouterr().err


def test_submit_and_generate_read_the_prompt_the_same_way(tmp_path):
    p = build_parser()
    msgs = [{"role": "user", "content": "hi"}]
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps({"messages": msgs}))
    for cmd in ("submit", "generate"):
        assert prompt_fields(p.parse_args([cmd, "--messages", json.dumps(msgs)])) == {"messages": msgs}
        assert prompt_fields(p.parse_args([cmd, "--chat", str(chat)])) == {"messages": msgs}
        assert prompt_fields(p.parse_args([cmd, "--tokens", "[1, 2]"])) == {"tokens": [1, 2]}
        args = p.parse_args([cmd, "--text", "x", "--keep", "0.3", "--model", "m"])
        assert selection_fields(args) == {"keep": 0.3, "draft_model": "m"}
        args = p.parse_args([cmd, "--text", "x", "--keep", "0.1", "--follow-chunks", "3"])
        assert selection_fields(args) == {"keep": 0.1, "follow_chunks": 3}
        with pytest.raises(ValueError, match="exactly one"):
            prompt_fields(p.parse_args([cmd, "--text", "x", "--tokens", "[1]"]))
        with pytest.raises(ValueError, match="--tokens: not valid JSON"):
            prompt_fields(p.parse_args([cmd, "--tokens", "[1,"]))
        with pytest.raises(ValueError, match="--file: cannot read"):
            prompt_fields(p.parse_args([cmd, "--file", str(tmp_path / "missing.txt")]))
        latin1 = tmp_path / "latin1.txt"
        latin1.write_bytes(b"caf\xe9")
        with pytest.raises(ValueError, match="--file: .*latin1.txt is not UTF-8 text"):
            prompt_fields(p.parse_args([cmd, "--file", str(latin1)]))


def test_iter_documents_reads_files_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "b.jsonl").write_text('{"id": "x", "text": "t", "n_tokens": 1}\n\n{"tokens": [1, 2]}\n')
    docs = [(d.id, d.fields, d.meta, d.error)
            for d in iter_documents([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")])]
    assert docs == [(str(tmp_path / "a.txt"), {"text": "hello"}, {}, None),
                    ("x", {"text": "t"}, {"n_tokens": 1}, None),
                    (f"{tmp_path / 'b.jsonl'}:3", {"tokens": [1, 2]}, {}, None)]


def test_demo_documents_have_two_rounds():
    docs = load_demo()
    assert len(docs) >= 2 and all({1, 2} <= set(d.questions) for d in docs)
    from tools import recall_task

    task = recall_task.load()
    for d in docs:  # each question's needle is where the document says, in the prompt's tokens
        for round_no in (1, 2):
            start, end = d.needle_span(round_no)
            tokens = task.encode(d.prompt(round_no))
            key = d.questions[round_no].split()[-1]
            assert task.decode(tokens[start:end]).split() == [key, *d.answers[round_no].split()]
            assert d.answered(round_no, f" {d.answers[round_no]}<|end|>")
            assert not d.answered(round_no, "wrong words here")


def test_tools_and_template_args_go_with_chat_input(tmp_path):
    p = build_parser()
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "search", "parameters": {}}}]
    tools_file = tmp_path / "tools.json"
    tools_file.write_text(json.dumps(tools))
    for cmd in ("submit", "generate"):
        args = p.parse_args([cmd, "--messages", json.dumps(msgs), "--tools", str(tools_file),
                             "--template-arg", "enable_thinking=false", "--template-arg", "style=terse"])
        assert prompt_fields(args) == {"messages": msgs, "tools": tools,
                                       "template_args": {"enable_thinking": False, "style": "terse"}}
        with pytest.raises(ValueError, match="only with --messages"):
            prompt_fields(p.parse_args([cmd, "--text", "x", "--tools", str(tools_file)]))
        with pytest.raises(ValueError, match="--template-arg: expected KEY=VALUE"):
            prompt_fields(p.parse_args([cmd, "--messages", json.dumps(msgs), "--template-arg", "oops"]))


def test_generate_summary_names_the_restored_prefix_and_a_fallback():
    from specprefill_cli.generate import summary_line

    data = {"job_id": "g", "generated_tokens": 3, "finish_reason": "eos", "ttft_s": 0.5, "kept": 10,
            "total": 10, "ratio": 1.0, "full_prefill": False, "target_tokens": {"restored": 256},
            "fallback": "fallback: draft failed: RuntimeError: x"}
    line = summary_line(data)
    assert "256 restored for the target" in line and line.endswith("[fallback: draft failed: RuntimeError: x]")
