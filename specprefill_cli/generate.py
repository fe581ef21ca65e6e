"""``specprefill generate``: the whole TTFT pipeline for one prompt, the text printed or streamed.

``--seed`` of a generate job seeds both the draft's lookahead and the sampling.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from specprefill_cli.options import (SharedOptions, add_generate_options, add_prompt_options, cli_holder, add_queue_option,
                         add_selection_options, add_wait_options, connect, generate_options, prompt_fields,
                         selection_fields)
from specprefill_cli.submit import print_failed, print_submitted, warn_if_no_worker
from specprefill_cli.waiting import interrupted, timed_out
from jobs.deadline import Deadline
from jobs.settings import Settings


def summary_line(data: dict[str, Any]) -> str:
    rate = data.get("tokens_per_s", {}).get("decode")
    restored = (data.get("target_tokens") or {}).get("restored", 0)
    return (f"{data['job_id']}: {data['generated_tokens']} tokens ({data['finish_reason']}), "
            f"TTFT {data['ttft_s']:.3f}s, kept {data['kept']}/{data['total']} "
            f"({100 * data['ratio']:.1f}%)" + (" [full prefill]" if data.get("full_prefill") else "")
            + (f", {restored} restored for the target" if restored else "")
            + (f", decode {rate:.1f} tok/s" if rate else "")
            + (f" - {data['keep_effect']}" if data.get("keep_effect") else "")
            + (f" [{data['fallback']}]" if data.get("fallback") else ""))


def stream(handle: Any, deadline: Deadline, out: Any) -> dict[str, Any]:
    """Print the text as it comes; the result JSON. After a retry that generated other
    text, the final text is printed on its own line."""
    from jobs.client import StreamDiverged

    try:
        for delta in handle.stream_text(timeout=deadline.left()):
            print(delta, end="", file=out, flush=True)
        diverged = False
    except StreamDiverged as exc:  # a retry sampled other text: show the final one
        print(file=out, flush=True)
        print(f"[{exc}]", file=sys.stderr, flush=True)
        diverged = True
    data = handle.result(timeout=deadline.left()).to_json()
    print(data["text"] if diverged else "", file=out, flush=True)
    return data


def run(args: argparse.Namespace, settings: Settings) -> int:
    from jobs.client import Client, JobFailed

    client = Client(connect(args, settings), settings, queue_name=args.queue)
    fields = {**selection_fields(args), **prompt_fields(args), **generate_options(args)}
    handle = client.submit(client.generate_spec(**fields), holder=cli_holder())
    if not (args.wait or args.stream):
        print_submitted(handle, args.json)
        return 0
    deadline = Deadline(args.timeout)  # one --timeout for the stream and the result together
    try:
        warn_if_no_worker(client)
        if args.stream:
            data = stream(handle, deadline, sys.stderr if args.json else sys.stdout)
        else:
            data = handle.result(timeout=deadline.left()).to_json()
    except JobFailed as exc:
        if args.stream:
            print(file=sys.stdout, flush=True)  # end a partly streamed line
        return print_failed(handle, exc, args.json)
    except TimeoutError:
        raise timed_out(client, handle.id, args.timeout) from None
    except KeyboardInterrupt:
        raise interrupted(handle.id) from None
    if args.json:
        print(json.dumps(data))
        return 0
    if not args.stream:
        print(data["text"])
    print(summary_line(data), file=sys.stderr)
    return 0


def register(sub: Any, shared: SharedOptions) -> None:
    p = sub.add_parser("generate", parents=[shared.common], help="generate text (SpecPrefill TTFT)",
                       description="Generate text: the draft selects the prompt's chunks, the target "
                                   "prefills only those and generates.")
    add_prompt_options(p)
    add_selection_options(p, shared.settings, seed_help="seeds the draft's lookahead and the sampling")
    add_generate_options(p)
    add_queue_option(p, shared.settings)
    p.add_argument("--stream", action="store_true", help="print the text as it is generated")
    add_wait_options(p, "block until the job ends, print the text", also_waiting=("--stream",))
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)
