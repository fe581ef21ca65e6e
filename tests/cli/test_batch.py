"""Issue 16, finding 6: batch resume is keyed on content + options, a document is never
written twice, bad documents are reported and skipped (exit 2), the demo's JSONL is accepted.
Through the real CLI against a Redis and a worker the test starts."""
from __future__ import annotations

import json
import os
import shutil

from tests.support.cli_procs import ROOT, cli, service  # noqa: F401

WORDS = "the and her in that it not be as for but is at all very".split()  # one token each (shipped BPE)
SMALL = ["--threshold", "64", "--tail-tokens", "32"]  # the documents are a few hundred tokens


def write_docs(tmp_path, n=4, words=400):
    paths = []
    for i in range(n):
        p = tmp_path / f"doc-{i}.txt"
        p.write_text(" ".join(WORDS[(i + j * (i + 1)) % len(WORDS)] for j in range(words)))
        paths.append(p)
    return paths


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def batch(service, out, *paths, extra=()):
    return cli("batch", *map(str, paths), "--out", str(out), "--redis-url", service.url, *SMALL, *extra)


def test_finding6_resume_is_keyed_on_content_and_options(service, tmp_path):
    docs, out = write_docs(tmp_path), tmp_path / "out.jsonl"
    first = batch(service, out, *docs)
    assert first.returncode == 0, first
    assert [r["status"] for r in lines(out)] == ["finished"] * 4
    assert "4 finished" in first.stdout

    relative = [os.path.relpath(p, ROOT) for p in docs]  # the same files by other paths
    again = batch(service, out, *relative)
    assert again.returncode == 0 and "4 already done" in again.stdout, again
    assert len(lines(out)) == 4

    before = out.read_text()
    other = batch(service, out, *docs, extra=("--keep", "0.1"))
    assert other.returncode == 2, other
    assert "other options (keep 0.2 -> 0.1)" in other.stderr and "another --out" in other.stderr
    assert out.read_text() == before  # the keep-0.2 results are neither kept as 0.1 nor duplicated
    by_relative = batch(service, out, *relative, extra=("--keep", "0.1"))  # issue 28 item 7c
    assert by_relative.returncode == 2 and "keep 0.2 -> 0.1" in by_relative.stderr, by_relative
    assert out.read_text() == before

    elsewhere = tmp_path / "keep01.jsonl"
    assert batch(service, elsewhere, *docs, extra=("--keep", "0.1")).returncode == 0
    assert {r["result"]["kept"] for r in lines(elsewhere)} != {r["result"]["kept"] for r in lines(out)}


def test_finding6_the_same_document_twice_is_written_once(service, tmp_path):
    (a,) = write_docs(tmp_path, 1)
    copy = tmp_path / "copy-of-doc-0.txt"
    shutil.copy(a, copy)
    out = tmp_path / "out.jsonl"
    res = batch(service, out, a, copy, a)
    assert res.returncode == 0, res
    assert len(lines(out)) == 1 and "given twice" in res.stdout


def test_finding6_bad_documents_are_skipped_and_the_rest_run(service, tmp_path):
    good = write_docs(tmp_path, 2)
    binary, empty, long = tmp_path / "image.png", tmp_path / "empty.txt", tmp_path / "long.txt"
    binary.write_bytes(bytes(range(256)) * 4)
    empty.write_text("  \n")
    long.write_text(" ".join(WORDS[i % len(WORDS)] for i in range(140_000)))  # over 131072 tokens
    out = tmp_path / "out.jsonl"
    res = batch(service, out, good[0], binary, empty, long, good[1])
    assert res.returncode == 2, res
    by_id = {r["id"]: r for r in lines(out)}
    assert by_id[str(good[0])]["status"] == by_id[str(good[1])]["status"] == "finished"
    assert "not UTF-8 text" in by_id[str(binary)]["error"] and "empty document" in by_id[str(empty)]["error"]
    assert by_id[str(long)]["bad_input"] and "140000 tokens, the limit is 131072" in by_id[str(long)]["error"]
    assert "JobSpecError" not in out.read_text()
    for path in (binary, empty):
        assert str(path) in res.stderr
    again = batch(service, out, good[0], binary, empty, long, good[1])
    assert again.returncode == 2 and "2 already done" in again.stdout
    assert sorted(r["id"] for r in lines(out)) == sorted(by_id)  # redone, not written twice


def test_finding6_the_demo_documents_are_accepted(service, tmp_path):
    out = tmp_path / "out.jsonl"
    res = cli("batch", str(ROOT / "models" / "demo" / "documents.jsonl"), "--out", str(out),
              "--threshold", "512", "--tail-tokens", "64", "--redis-url", service.url)
    assert res.returncode == 0, res
    recs = lines(out)
    assert len(recs) == 12 and all(r["status"] == "finished" for r in recs)
    assert all(r["meta"]["n_tokens"] == r["result"]["total"] for r in recs)  # unknown fields are metadata
