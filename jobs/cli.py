"""The ``specprefill`` command: worker, submit, generate, watch, batch, cache stats, demo."""
from jobs.settings import Settings  # imports no mlx
from specprefill.blas import preload_openblas


def _preload_blas() -> None:
    """Before anything can import mlx (the worker loads models); main() reports bad settings."""
    try:
        settings = Settings.from_env()
    except ValueError:
        settings = Settings()
    preload_openblas(settings.openblas, settings.openblas_path or None)


_preload_blas()

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Iterable, Iterator, Sequence, TextIO  # noqa: E402

import redis  # noqa: E402

from jobs.cli_args import (Deadline, add_prompt_options, add_selection_options, prompt_fields,  # noqa: E402
                           selection_fields)
from jobs.cli_generate import add_generate_options, register as register_generate  # noqa: E402
from jobs.client import EnqueueConflict  # noqa: E402
from jobs.connection import queue_connection  # noqa: E402
from server.cli import register as register_serve  # noqa: E402 - the HTTP server's commands


class CliError(Exception):
    """A user-facing error: printed without a traceback, exit status 2."""


# ---- shared helpers ----

def _connect(args: argparse.Namespace, settings: Settings) -> redis.Redis:
    url = args.redis_url or settings.redis_url
    if not url:
        raise CliError("no Redis URL: pass --redis-url or set REDIS_URL "
                       "(redis://[:password@]host:port/db, rediss:// for TLS)")
    client = queue_connection(url, settings)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise CliError(f"cannot reach Redis at {_safe(url)}: {exc}") from None
    return client


def _safe(url: str) -> str:
    """The URL with any password masked (for messages)."""
    if "@" not in url:
        return url
    scheme, rest = url.split("://", 1) if "://" in url else ("", url)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0] if ":" in creds else ""
    return f"{scheme}://{user}:***@{host}"


def _spec_fields(args: argparse.Namespace) -> dict[str, Any]:
    fields = selection_fields(args)
    if getattr(args, "importance", False):
        fields["return_importance"] = True
    if getattr(args, "spans", False):
        fields["return_spans"] = True
    return fields


def _bar(done: float, total: float, width: int = 24) -> str:
    frac = 0.0 if total <= 0 else min(1.0, done / total)
    full = int(frac * width)
    return "[" + "#" * full + "-" * (width - full) + f"] {100 * frac:5.1f}%"


def _describe(ev: Any) -> str:
    d = ev.data
    if ev.kind == "scoring":
        eta = f", eta {d['eta_s']:.1f}s" if d.get("eta_s") is not None else ""
        return f"scoring {_bar(d['processed'], d['total'])} {d['processed']}/{d['total']} " \
               f"({d.get('tokens_per_s', 0):.0f} tok/s{eta})"
    if ev.kind == "cache_lookup":
        return f"cache lookup: {d.get('hit_tokens', 0)}/{d.get('total', '?')} tokens cached" + \
               (" (memo)" if d.get("memo") else "")
    if ev.kind == "selection":
        return f"selection: kept {d['kept']}/{d['total']}"
    if ev.kind == "target_prefill":
        return f"target prefill {_bar(d['processed'], d['total'])} {d['processed']}/{d['total']}"
    if ev.kind == "decode":
        return f"decode: {d['tokens']}/{d['max_tokens']} tokens ({d.get('tokens_per_s', 0):.1f} tok/s)"
    if ev.kind == "text":
        return f"text: {d.get('delta', '')!r}"
    if ev.kind == "failed":
        return f"failed: {d.get('error', '')}"
    extra = ", ".join(f"{k}={v}" for k, v in d.items())
    return f"{ev.kind}" + (f" ({extra})" if extra else "")


def _result_json(res: Any) -> dict[str, Any]:
    return res.to_json() if hasattr(res, "to_json") else dict(res)


# ---- worker ----

def cmd_worker(args: argparse.Namespace, settings: Settings) -> int:
    import logging

    from worker.rq_worker import run_worker
    from worker.runtime import WorkerRuntime

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.preload:  # one source of truth: the allow-list admits what the worker preloads
        settings = settings.replace(preload_models=tuple(args.preload))
    conn = _connect(args, settings)
    runtime = WorkerRuntime.from_settings(settings, conn)
    run_worker(runtime, args.queue or settings.queues,
               preload=settings.preload_models, name=args.name,
               burst=args.burst, logging_level=args.log_level, max_jobs=args.max_jobs)
    return 0


# ---- submit / watch ----

def _watch(handle: Any, out: TextIO, *, as_json: bool, timeout: float | None) -> Any:
    """Print a job's events as they come (a live bar on a terminal); return the last one."""
    last, tty = None, out.isatty()
    for ev in handle.events(timeout=timeout):
        last = ev
        if as_json:
            print(ev.to_json(), file=out, flush=True)
        elif tty and ev.kind == "scoring":  # redraw one line
            print(f"\r\033[K{handle.id[:24]}  {_describe(ev)}", end="", file=out, flush=True)
        else:
            print(f"{chr(13) + chr(27) + '[K' if tty else ''}{handle.id[:24]}  {_describe(ev)}",
                  file=out, flush=True)
    return last


def cmd_submit(args: argparse.Namespace, settings: Settings) -> int:
    from jobs.client import Client, JobFailed

    client = Client(_connect(args, settings), settings)
    handle = client.submit(**prompt_fields(args), **_spec_fields(args))
    if not args.wait:
        info = {"job_id": handle.id, "status": handle.status(), "created": handle.created}
        print(json.dumps(info) if args.json else f"{handle.id} {info['status']}"
              + ("" if handle.created else " (already submitted)"))
        return 0
    deadline = Deadline(args.timeout)  # one --timeout for watching and the result together
    if not args.json:
        _watch(handle, sys.stderr, as_json=False, timeout=deadline.left())
    try:
        res = handle.result(timeout=deadline.left())
    except JobFailed as exc:
        print(json.dumps({"job_id": handle.id, "status": exc.status, "error": exc.error})
              if args.json else str(exc))
        return 1
    data = _result_json(res)
    if args.json:
        print(json.dumps(data))
    else:
        print(f"{handle.id}: kept {data['kept']}/{data['total']} tokens ({100 * data['ratio']:.1f}%)"
              + (f" - {data['reason']}" if data.get("reason") else "")
              + f"; {data['cached_tokens']} from the block store"
              + ("; memo hit" if data.get("memo_hit") else ""))
    return 0


def cmd_watch(args: argparse.Namespace, settings: Settings) -> int:
    from jobs.client import Client

    client = Client(_connect(args, settings), settings)
    last = _watch(client.handle(args.job), sys.stdout, as_json=args.json, timeout=args.timeout)
    return 0 if last is not None and last.kind == "done" else 1


# ---- batch ----

def iter_documents(paths: Sequence[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(document id, spec fields) from plain files (id = path) and JSONL files.

    A JSONL line holds ``id`` (else ``<path>:<line>``) and one of ``text``, ``tokens``,
    ``messages``; any other spec fields on the line apply to that document.
    """
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise CliError(f"{path}: no such file")
        try:
            content = p.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise CliError(f"{path}: cannot read it as UTF-8 text: {exc}") from None
        if p.suffix == ".jsonl":
            for n, line in enumerate(content.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    doc = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise CliError(f"{path}:{n}: not valid JSON: {exc}") from None
                if not isinstance(doc, dict):
                    raise CliError(f"{path}:{n}: expected a JSON object")
                doc_id = str(doc.pop("id", f"{path}:{n}"))
                yield doc_id, doc
        else:
            yield str(p), {"text": content}


def _done_ids(out_path: Path) -> set[str]:
    done = set()
    if out_path.exists():
        for line in out_path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by an interrupted run is redone
            if rec.get("status") == "finished":
                done.add(rec["id"])
    return done


def run_batch(client: Any, docs: list[tuple[str, dict[str, Any]]], out_path: Path, *,
              common: dict[str, Any], progress: TextIO | None, timeout: float | None = None,
              poll_s: float = 0.3) -> dict[str, Any]:
    """Submit ``docs`` not yet finished in ``out_path``, append one line per document as
    each ends, and return a summary. Re-running skips documents already written."""
    from jobs.client import JobFailed

    done = _done_ids(out_path)
    todo = [(doc_id, fields) for doc_id, fields in docs if doc_id not in done]
    summary = {"documents": len(docs), "skipped": len(docs) - len(todo), "finished": 0,
               "failed": 0, "cached_tokens": 0, "kept": 0, "total": 0, "elapsed_s": 0.0}
    if not todo:
        return summary
    specs = []
    for doc_id, fields in todo:  # validated one by one so an error names its document
        try:
            specs.append(client.spec(**{**common, **fields}))
        except ValueError as exc:
            raise CliError(f"document {doc_id}: {exc}") from None
    t0 = time.perf_counter()
    batch = client.submit_many(specs)
    pending = dict(zip((h.id for h in batch.handles), (d for d, _ in todo)))
    by_job: dict[str, list[str]] = {}
    for h, (doc_id, _) in zip(batch.handles, todo):
        by_job.setdefault(h.id, []).append(doc_id)
    deadline = None if timeout is None else time.monotonic() + timeout
    unfinished: list[str] = []
    outage_wait = poll_s
    with open(out_path, "a") as out:
        while pending:
            try:
                view = batch.progress()
                for job_id in list(pending):
                    ev = view.last_events.get(job_id)
                    status = client.handle(job_id).status() if ev is None or ev.terminal else None
                    if status not in ("finished", "failed", "stopped", "canceled", "missing"):
                        continue
                    rec: dict[str, Any] = {"job_id": job_id, "status": status}
                    try:
                        res = _result_json(client.handle(job_id).result(timeout=5))
                        rec["result"] = res
                    except JobFailed as exc:
                        rec.update(status=exc.status, error=exc.error)
                    pending.pop(job_id)  # only once its line is certain to be written
                    n_docs = len(by_job[job_id])
                    if "result" in rec:
                        summary["finished"] += n_docs
                        summary["cached_tokens"] += rec["result"]["cached_tokens"] * n_docs
                        summary["kept"] += rec["result"]["kept"]
                        summary["total"] += rec["result"]["total"]
                    else:
                        summary["failed"] += n_docs
                        unfinished.extend(by_job[job_id])
                    for doc_id in by_job[job_id]:
                        out.write(json.dumps({"id": doc_id, **rec}) + "\n")
                    out.flush()
                outage_wait = poll_s
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                # Redis restarting: keep watching (jobs it lost come back as "missing").
                if progress is not None:
                    print(f"\nbatch: Redis unavailable ({exc}); retrying in {outage_wait:.1f}s",
                          file=progress, flush=True)
                view = None
                time.sleep(outage_wait)
                outage_wait = min(outage_wait * 2, 10.0)
            if progress is not None and view is not None:
                _print_batch(progress, view, by_job, summary, time.perf_counter() - t0)
            if not pending:
                break
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"batch: {len(pending)} documents still running after {timeout}s")
            time.sleep(poll_s)
    summary["unfinished"] = unfinished
    if progress is not None and progress.isatty():
        print(file=progress)
    summary["elapsed_s"] = round(time.perf_counter() - t0, 2)
    return summary


def _print_batch(out: TextIO, view: Any, by_job: dict[str, list[str]], summary: dict,
                 elapsed_s: float) -> None:
    eta = f" eta {view.eta_s:.0f}s" if view.eta_s else ""
    line = (f"overall {_bar(view.finished, view.total)} done {view.done} failed {view.failed} "
            f"running {view.running} queued {view.queued} | {view.rates_text(summary['total'], elapsed_s)}{eta}")
    running = []
    for job_id, ev in view.last_events.items():
        if ev.kind == "scoring" and not ev.terminal:
            running.append(f"{by_job.get(job_id, [job_id])[0]} "
                           f"{100 * ev.data['processed'] / max(1, ev.data['total']):.0f}%")
    if running:
        line += " | " + ", ".join(running[:4])
    if out.isatty():
        print("\r\033[K" + line[:200], end="", file=out, flush=True)
    else:
        print(line, file=out, flush=True)


def cmd_batch(args: argparse.Namespace, settings: Settings) -> int:
    from jobs.cli_generate import generate_documents, generate_options
    from jobs.client import Client

    client = Client(_connect(args, settings), settings)
    if args.openai:  # an OpenAI Batch API file (package server)
        from server.offline_batch import cmd_openai_batch
        return cmd_openai_batch(client, args, defaults=_spec_fields(args))
    if not args.paths:
        raise CliError("give text or .jsonl files to run, or --openai REQUESTS.jsonl")
    docs = list(iter_documents(args.paths))
    if args.generate or args.question is not None or any("question" in f for _, f in docs):
        docs = generate_documents(docs, question=args.question,
                                  options=generate_options(args) if args.generate else None)
    summary = run_batch(client, docs, Path(args.out), common=_spec_fields(args),
                        progress=None if args.json else sys.stderr, timeout=args.timeout)
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{summary['documents']} documents: {summary['finished']} finished, "
              f"{summary['failed']} failed, {summary['skipped']} already done; "
              f"results in {args.out}")
        if summary.get("unfinished"):
            shown = ", ".join(summary["unfinished"][:10])
            more = len(summary["unfinished"]) - 10
            print(f"not finished: {shown}{f' and {more} more' if more > 0 else ''} "
                  "(their lines in the output say why; run the same command again to redo them)")
    return 0 if summary["failed"] == 0 else 1


# ---- cache stats ----

def cache_stats(client: redis.Redis, namespace: str) -> dict[str, Any]:
    """Block-store counters per model fingerprint and in total, plus key counts."""
    per_model: dict[str, dict[str, int]] = {}
    for key in client.scan_iter(match=f"{namespace}:kvstats:*", count=500):
        k = key.decode() if isinstance(key, bytes) else key
        per_model[k.rsplit(":", 1)[1]] = {
            (f.decode() if isinstance(f, bytes) else f): int(v) for f, v in client.hgetall(key).items()}
    totals: dict[str, int] = {}
    for counters in per_model.values():
        for f, v in counters.items():
            totals[f] = totals.get(f, 0) + v
    blocks = sum(1 for _ in client.scan_iter(match=f"{namespace}:kv:*", count=1000))
    memos = sum(1 for _ in client.scan_iter(match=f"{namespace}:memo:*", count=1000))
    return {"namespace": namespace, "blocks": blocks, "memo_entries": memos,
            "used_memory": int(client.info("memory").get("used_memory", 0)),
            "totals": totals, "models": per_model}


def cmd_cache(args: argparse.Namespace, settings: Settings) -> int:
    url = args.redis_url or settings.block_store_url
    stats = cache_stats(_connect(argparse.Namespace(redis_url=url), settings), settings.namespace)
    if args.json:
        print(json.dumps(stats))
        return 0
    t = stats["totals"]
    print(f"namespace {stats['namespace']}: {stats['blocks']} blocks, {stats['memo_entries']} memo "
          f"entries, {stats['used_memory'] / 1e6:.1f} MB used")
    for name in ("lookups", "hit_blocks", "hit_tokens", "stores", "blocks_written", "bytes_written",
                 "corrupt_blocks", "memo_lookups", "memo_hits", "memo_writes", "memo_corrupt"):
        if name in t:
            print(f"  {name:<15} {t[name]}")
    return 0


# ---- parser ----

def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--redis-url", default=None,
                        help="redis://[:password@]host:port/db or rediss:// (default: REDIS_URL)")
    spec = argparse.ArgumentParser(add_help=False)
    add_selection_options(spec)
    spec.add_argument("--importance", action="store_true", help="return the importance vector")
    spec.add_argument("--spans", action="store_true", help="return the kept text spans")

    p = argparse.ArgumentParser(prog="specprefill", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    w = sub.add_parser("worker", parents=[common], help="run an RQ worker")
    w.add_argument("--queue", action="append", help="queue to work (repeatable)")
    w.add_argument("--preload", action="append", help="draft model to load at start (repeatable)")
    w.add_argument("--name")
    w.add_argument("--burst", action="store_true", help="quit when the queues are empty")
    w.add_argument("--max-jobs", type=int)
    w.add_argument("--log-level", default="INFO")
    w.set_defaults(func=cmd_worker)

    s = sub.add_parser("submit", parents=[common, spec], help="submit one job")
    add_prompt_options(s)
    s.add_argument("--wait", action="store_true", help="block until the job ends")
    s.add_argument("--json", action="store_true")
    s.add_argument("--timeout", type=float)
    s.set_defaults(func=cmd_submit)

    wa = sub.add_parser("watch", parents=[common], help="follow a job's progress")
    wa.add_argument("job")
    wa.add_argument("--json", action="store_true", help="one event per line as JSON")
    wa.add_argument("--timeout", type=float)
    wa.set_defaults(func=cmd_watch)

    b = sub.add_parser("batch", parents=[common, spec], help="run many documents")
    b.add_argument("paths", nargs="*", help="text files or .jsonl files")
    b.add_argument("--out", required=True, help="results JSONL (appended; done documents skipped)")
    b.add_argument("--json", action="store_true", help="print the summary as JSON")
    b.add_argument("--timeout", type=float)
    b.add_argument("--generate", action="store_true",
                   help="run generate jobs (results hold the text); --seed also seeds sampling")
    b.add_argument("--question", help="appended to every document (a JSONL 'question' wins)")
    add_generate_options(b)
    b.set_defaults(func=cmd_batch)

    register_generate(sub, common)
    register_serve(sub, common, batch=b)  # serve, and batch --openai (package server)

    c = sub.add_parser("cache", parents=[common], help="block store information")
    c.add_argument("action", choices=["stats"])
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_cache)

    d = sub.add_parser("demo", parents=[common], help="run the shipped demo end to end")
    d.add_argument("--workers", type=int, default=2)
    d.add_argument("--documents", type=int, default=None, help="use only the first N documents")
    d.add_argument("--model", help="draft model (default: the shipped draft-tiny)")
    d.add_argument("--timeout", type=float, default=600)
    d.set_defaults(func=_cmd_demo)
    return p


def _cmd_demo(args: argparse.Namespace, settings: Settings) -> int:
    from jobs.demo import run_demo

    return run_demo(args, settings)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = Settings.from_env()
        return int(args.func(args, settings) or 0)
    except CliError as exc:
        print(f"specprefill {args.command}: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # JobSpecError and bad settings name the field
        print(f"specprefill {args.command}: {exc}", file=sys.stderr)
        return 2
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        print(f"specprefill {args.command}: lost the connection to Redis: {exc} "
              "(a batch can be re-run: finished documents are skipped)", file=sys.stderr)
        return 3
    except EnqueueConflict as exc:
        print(f"specprefill {args.command}: {exc}", file=sys.stderr)
        return 3
    except TimeoutError as exc:  # --timeout ran out; the job itself goes on
        print(f"specprefill {args.command}: --timeout: {exc} (the job keeps running: follow it "
              "with `specprefill watch JOB_ID`; a re-run batch picks up the finished documents)",
              file=sys.stderr)
        return 4
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
