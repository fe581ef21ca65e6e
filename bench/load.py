"""Many requests at once (issue 39): this service against ``mlx_lm.server``, side by side in one run.

The same model folder (``models/target-tiny``; the shipped draft where SpecPrefill selects) and the
same requests through each server's OpenAI chat-completions API, streamed, greedy, on loopback:
``mlx_lm.server`` (mlx-lm's own continuously batching server, on the same OpenBLAS) and this
service (``specprefill serve``, one worker, a private Redis) with one job in flight (today), and,
when the worker has the batching engine (``max_jobs_in_flight``), batching with SpecPrefill off
and on. Servers take turns at every step, so each figure's neighbours ran at the same moment.

Workloads (``bench/load_workloads.py``): decode-bound (short prompts answered to 256 tokens),
prefill-bound (~4K-token prompts, 32 tokens), mixed (short requests arriving 1.5 s after two
~16K-token prompts), and an agent trace (conversations sharing a system prompt, 1-2K-token tool
results, answers up to 100 tokens, think time between turns), at each concurrency (clients, or
conversations, at once). Figures as ``vllm bench serve`` names them: request_throughput (req/s),
output_throughput (tok/s), ttft / tpot / itl / e2el at p50 and p99 (seconds), goodput at each
TTFT SLO of ``--slo-ttft`` (req/s that met it). Ends with the issue's ``target ...`` lines; the
agent trace's goodput target is taken at ``--agent-slo-ttft``. Every request is
bounded in time, and so is the run (``--max-minutes``: what is left is skipped, and said so).

    .venv/bin/python -m bench.load                         # every workload, concurrency 1 2 4 8 16
    .venv/bin/python -m bench.load --levels 1 8 --workloads decode prefill
    .venv/bin/python -m bench.load --quick                 # small sizes, concurrency 2: a minute or two
"""
from __future__ import annotations

import argparse
import asyncio
import math
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from bench.benchlib import report
from bench.load_client import Record, client, closed_loop, goodput_name, stream_chat, summarize
from bench.load_servers import (PEER, SPECPREFILL_ON, Mode, Server, engine_present, service_modes, settle, start_peer,
                                start_service)
from bench.load_workloads import Request, Sizes, Texts, agent_trace

WORKLOADS = ("decode", "prefill", "mixed", "agent")
LEVELS = (1, 2, 4, 8, 16)
SLO_SWEEP_S = (1.0, 2.0, 5.0, 10.0, 30.0)  # goodput's TTFT SLOs, one column each
AGENT_SLO_TTFT_S = 10.0  # agent_trace_goodput_vs_mlx_lm: a turn's first token within this (docs/load.md)
TARGET_LEVEL = 8  # the throughput targets: 8 clients at once
# --quick (the suite's run, on a CPU without OpenBLAS too): every workload and mode at half the
# prompt sizes of before, SpecPrefill's threshold and tail scaled with them, so it still selects.
QUICK = Sizes(min_requests=2, decode_tokens=64, prefill_tokens=512, prefill_answer=16, long_tokens=512,
              mixed_short=2, mixed_delay_s=0.5, system_tokens=128, tool_tokens=(128, 256), turns=2, answer_tokens=32)
QUICK_SPECPREFILL_ON = {**SPECPREFILL_ON, "threshold": 256, "tail_tokens": 64}


@dataclass
class Run:
    """Everything measured: (workload, level, server) -> records, and what was skipped."""

    records: dict[tuple[str, str, str], list[Record]] = field(default_factory=dict)
    requests: dict[tuple[str, str], list[Request]] = field(default_factory=dict)  # the closed-loop sets
    skipped: list[str] = field(default_factory=list)
    deadline: float = math.inf
    settled: float = 0.0  # seconds spent waiting for the servers' leftover work (heals) before runs
    slos: tuple[float, ...] = SLO_SWEEP_S  # goodput's TTFT SLOs (seconds)

    def late(self, what: str) -> bool:
        if time.monotonic() > self.deadline:
            self.skipped.append(what)
            return True
        return False


async def _closed(server: Server, requests: list[Request], level: int, extra: dict | None = None) -> list[Record]:
    async with client(server.url) as sdk:
        bodies = [(server.body(r, extra), r.key) for r in requests]
        return await closed_loop([lambda b=b, k=k: stream_chat(sdk, b, k) for b, k in bodies], level)


async def _mixed(server: Server, long: list[Request], short: list[Request], delay_s: float) -> list[Record]:
    """The long prompts at once, the short ones ``delay_s`` later, all concurrently."""
    async with client(server.url) as sdk:
        first = [asyncio.create_task(stream_chat(sdk, server.body(r), r.key)) for r in long]
        await asyncio.sleep(delay_s)
        later = [asyncio.create_task(stream_chat(sdk, server.body(r), r.key)) for r in short]
        return list(await asyncio.gather(*first, *later))


async def _agent(server: Server, conversations: list, answer_tokens: int) -> list[Record]:
    """Every conversation at once from its start time: a turn, its answer into the history, a think."""
    records: list[Record] = []

    async def converse(sdk, conv) -> None:
        await asyncio.sleep(conv.start_s)
        history: list[dict] = []
        for turn, think in enumerate(conv.think_s):
            request = conv.request(history, turn, answer_tokens)
            record = await stream_chat(sdk, server.body(request), request.key)
            records.append(record)
            if not record.ok:
                return
            history += [request.messages[-1], {"role": "assistant", "content": record.text}]
            if turn + 1 < len(conv.think_s):
                await asyncio.sleep(think)

    async with client(server.url) as sdk:
        await asyncio.gather(*(converse(sdk, c) for c in conversations))
    return records


def plan(run: Run, texts: Texts, workload: str, level: int, seed: int) -> tuple[str, Callable]:
    """(the level's label, server -> a coroutine of its records) for one workload at one level."""
    sizes = texts.sizes
    if workload == "mixed":  # level 0: short requests alone, at once (others: this service keeps results)
        long, short = texts.mixed(seed)
        if level == 0:
            return f"0+{len(short)}", lambda server: _mixed(server, [], short, 0.0)
        return f"2+{len(short)}", lambda server: _mixed(server, long, short, sizes.mixed_delay_s)
    if workload == "agent":
        conversations = agent_trace(texts, seed, level)
        return str(level), lambda server: _agent(server, conversations, sizes.answer_tokens)
    if workload == "decode":
        requests = texts.decode_bound(seed, max(sizes.min_requests, 2 * level))
    else:
        requests = texts.prefill_bound(seed, max(sizes.min_requests, level))
    assert len({r.key for r in requests}) == len(requests), "a key names one request (texts are compared by key)"
    run.requests[(workload, str(level))] = requests
    return str(level), lambda server: _closed(server, requests, level)


def measure(run: Run, servers: list[Server], texts: Texts, workload: str, level: int, seed: int) -> None:
    """One workload at one level on every server, in turn (the order rotates with the seed)."""
    if run.late(f"{workload} c{level}"):
        return
    label, load = plan(run, texts, workload, level, seed)
    for server in servers[seed % len(servers):] + servers[:seed % len(servers)]:
        if run.late(f"{workload} c{label} on {server.name}"):
            continue
        waited = settle(servers)
        started = time.monotonic()
        records = run.records[(workload, label, server.name)] = asyncio.run(load(server))
        failed = [r.error for r in records if not r.ok]
        print(f"  {workload} c{label} {server.name}: {len(records) - len(failed)}/{len(records)} done in "
              f"{time.monotonic() - started:.1f} s (after {waited:.1f} s idle wait)"
              + (f"; first error: {failed[0]}" if failed else ""), flush=True)
        run.settled += waited


def alone_check(run: Run, modes: list[Mode], level: int, logs: Path, engine: bool, on: dict) -> None:
    """The decode and prefill requests of ``level`` again, one at a time, on a fresh stack of each
    of this service's modes (nothing stored by the loaded run: no restored prefix, no healed
    conversation, no shared job), for their texts to be compared with the loaded ones."""
    for mode in modes:  # bounded by its request count, not by --max-minutes
        sets = [(w, run.requests[(w, str(level))]) for w in ("decode", "prefill") if (w, str(level)) in run.requests]
        if not sets:
            continue
        server = start_service(mode, logs, engine, "-alone", on)
        try:
            for workload, requests in sets:
                run.records[(workload, "alone", mode.name)] = asyncio.run(_closed(server, requests, 1))
        finally:
            server.stop()


COLUMNS = ("completed", "request_throughput", "output_throughput", "p50_ttft", "p99_ttft", "p50_tpot", "p99_tpot",
           "p50_itl", "p99_itl", "p50_e2el", "p99_e2el")  # then goodput at each SLO of the sweep


def _cell(value: float | int | None) -> str:
    """A table cell: integers as they are, figures to 3 significant digits, '-' for none."""
    if value is None:
        return "-"
    return str(value) if isinstance(value, int) else f"{value:.3g}"


def rows(run: Run) -> list[tuple[str, str, str, list[Record]]]:
    """(workload, level, server, records) in table order (the peer first at each level); the mixed
    run as its long and short parts."""
    out = []
    order = sorted(run.records, key=lambda k: (WORKLOADS.index(k[0]), int(k[1]) if k[1].isdigit() else 99,
                                               k[1], k[2] != PEER, k[2]))
    for workload, label, server in order:
        records = run.records[(workload, label, server)]
        if workload == "mixed":
            parts = {part: [r for r in records if r.key.startswith(f"{part}-")] for part in ("long", "short")}
            out += [(f"mixed {part}", label, server, rs) for part, rs in parts.items() if rs]
        else:
            out.append((workload, label, server, records))
    return out


def print_table(run: Run) -> None:
    """One row per workload, level and server (``vllm bench serve``'s figures), then the units."""
    columns = COLUMNS + tuple(goodput_name(slo) for slo in run.slos)
    print(f"\n| workload | c | server | in tok | out tok | {' | '.join(columns)} |")
    print("|---|---:|---|" + "---:|" * (len(columns) + 2))
    for workload, label, server, records in rows(run):
        s = summarize(records, run.slos)
        done = [r for r in records if r.ok]
        prompt = sum(r.prompt_tokens for r in done) / len(done) if done else None
        output = s.get("mean_output_tokens")
        cells = [_cell(s.get(c)) if c != "completed" else f"{s['completed']}/{len(records)}" for c in columns]
        print(f"| {workload} | {label} | {server} | {_cell(prompt and round(prompt))} | "
              f"{_cell(output and round(output))} | {' | '.join(cells)} |")
    print("\nseconds for ttft/tpot/itl/e2el; req/s for request_throughput and goodput@Ns (completed requests "
          "whose TTFT <= N s, per second); output tokens/s for output_throughput; c: clients (agent: "
          "conversations) at once")


def figure(run: Run, workload: str, label: str, server: str, name: str, part: str = "") -> float:
    """One summary figure of one run (its requests whose key starts with ``part``); NaN if not run."""
    records = run.records.get((workload, label, server))
    if records is None:
        return math.nan
    if part:
        records = [r for r in records if r.key.startswith(part)]
    value = summarize(records, run.slos).get(name)
    return math.nan if value is None else value


def nearest(run: Run, workload: str, want: int, servers: tuple[str, str]) -> str | None:
    """The measured level closest to ``want`` on both servers (as a label)."""
    have = sorted({int(lv) for (w, lv, s) in run.records if w == workload and lv.isdigit()
                   and all((w, lv, name) in run.records for name in servers)}, key=lambda lv: (abs(lv - want), lv))
    return str(have[0]) if have else None


def where(level: str, want: int) -> str:
    """The level a target was taken at, and the wanted one if that was not measured."""
    return f"c{level}" + ("" if level == str(want) else f", c{want} not measured")


def ratio(ours: float, theirs: float) -> float:
    """``ours / theirs``; NaN when theirs is 0 (no ratio: the target fails, its line says why)."""
    return ours / theirs if theirs else math.nan


def _first_difference(a: str, b: str) -> str:
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"{len(a)} vs {len(b)} characters, first difference at {at}: {a[at:at + 40]!r} vs {b[at:at + 40]!r}"


def same_texts(run: Run, server: str) -> tuple[int, int]:
    """(requests whose text alone equals their text batched, requests compared); each one that
    differs is printed."""
    equal = total = 0
    for (workload, label, name), alone in run.records.items():
        if label != "alone" or name != server:
            continue
        batched = {r.key: r for level_key, records in run.records.items()
                   if level_key[0] == workload and level_key[2] == server and level_key[1] != "alone"
                   for r in records if r.ok}
        for record in alone:
            if record.ok and record.key in batched:
                total += 1
                equal += record.text == batched[record.key].text
                if record.text != batched[record.key].text:
                    print(f"{server}: {record.key} under load vs alone: "
                          f"{_first_difference(batched[record.key].text, record.text)}")
    return equal, total


def agent_target(run: Run, source: str, note: str, slo: float) -> tuple:
    """``agent_trace_goodput_vs_mlx_lm``: goodput at a turn's TTFT SLO ``slo``, ours / the peer's.
    Where the peer's goodput is 0 there (no ratio), it is taken at the tightest looser SLO of the
    sweep where the peer's is not; where it is 0 at every one, at the tightest SLO where it is not
    at all (the peer's fastest turn's TTFT). The line says which; NaN when the peer did no turn."""
    name, op, bound = "agent_trace_goodput_vs_mlx_lm", ">=", 2.0
    level = nearest(run, "agent", TARGET_LEVEL, (source, PEER))
    if level is None:
        return (name, math.nan, op, bound, f"not measured{note}")
    at_level = where(level, TARGET_LEVEL)

    def goodput(server: str, at: float) -> float:
        return summarize(run.records[("agent", level, server)], (at,)).get(goodput_name(at), 0.0)

    looser = [slo] + sorted(s for s in run.slos if s > slo)
    at = next((s for s in looser if goodput(PEER, s) > 0), None)
    moved = "" if at in (slo, None) else (f"; the peer's is 0 at {slo:g} s: taken at {at:g} s, the tightest "
                                          "SLO of the sweep where it is not")
    if at is None:
        peer_ttfts = [r.ttft for r in run.records[("agent", level, PEER)] if r.ok]
        if not peer_ttfts:
            return (name, math.nan, op, bound, f"no ratio [the peer completed no turn, {at_level}{note}]")
        at = min(peer_ttfts)
        moved = (f"; the peer's goodput is 0 at every SLO of the sweep ({slo:g} to {looser[-1]:g} s): taken at "
                 f"its fastest turn's TTFT, the tightest SLO where it is not 0")
    ours, peer = goodput(source, at), goodput(PEER, at)
    return (name, ours / peer, op, bound, f"{ours / peer:.3f} [goodput at TTFT <= {at:.3g} s: {ours:.3g} ours / "
            f"{peer:.3g} peer req/s, {at_level}{moved}{note}]")


def targets(run: Run, source: str, note: str, agent_slo: float) -> list[tuple]:
    """The issue's six targets for ``source`` (this service's mode), against the peer."""
    pair = (source, PEER)

    def vs_peer(name: str, workload: str, want: int, figure_name: str, op: str, bound: float) -> tuple:
        level = nearest(run, workload, want, pair)
        if level is None:
            return (name, math.nan, op, bound, f"not measured{note}")
        ours, peer = (figure(run, workload, level, s, figure_name) for s in pair)
        value = ratio(ours, peer)
        return (name, value, op, bound,
                f"{value:.3f} [{figure_name} {ours:.3g} ours / {peer:.3g} peer, {where(level, want)}{note}]")

    mixed = next((k[1] for k in run.records if k[0] == "mixed" and not k[1].startswith("0+")), "")
    short, long = (figure(run, "mixed", mixed, source, "p50_ttft", part) for part in ("short-", "long-"))
    equal, total = same_texts(run, source)
    same = equal / total if total else math.nan
    return [
        vs_peer("decode_bound_rps_vs_mlx_lm_c8", "decode", TARGET_LEVEL, "request_throughput", ">=", 1.0),
        vs_peer("prefill_bound_rps_vs_mlx_lm_c8", "prefill", TARGET_LEVEL, "request_throughput", ">=", 3.5),
        ("short_ttft_behind_long_vs_long_ttft", ratio(short, long), "<=", 0.1,
         f"{ratio(short, long):.3f} [p50 TTFT short {short:.3g} s / long {long:.3g} s{note}]"),
        vs_peer("single_short_ttft_vs_mlx_lm", "decode", 1, "p50_ttft", "<=", 1.5),
        agent_target(run, source, note, agent_slo),
        ("batched_vs_alone_greedy_tokens", same, ">=", 1.0,
         f"{same:.3f} [{equal}/{total} texts equal alone and under load{note}]"),
    ]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--levels", nargs="+", type=int, default=list(LEVELS), help="clients (conversations) at once")
    p.add_argument("--slo-ttft", type=float, nargs="+", default=list(SLO_SWEEP_S),
                   help="goodput's TTFT SLOs, seconds: a goodput column each")
    p.add_argument("--agent-slo-ttft", type=float, default=AGENT_SLO_TTFT_S,
                   help="the agent trace's goodput target's TTFT SLO, seconds (added to the sweep)")
    p.add_argument("--in-flight", type=int, default=max(LEVELS), help="max_jobs_in_flight of the batching modes")
    p.add_argument("--max-minutes", type=float, default=60.0,
                   help="the loads' bound: what is left is skipped, highest levels first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="small sizes at concurrency 2 (the suite's run)")
    args = p.parse_args(argv)
    if args.quick:
        args.levels, args.max_minutes = [2], min(args.max_minutes, 10.0)
    return args


def schedule(args: argparse.Namespace) -> list[tuple[int, str]]:
    """(level, workload) in run order: the mixed workload once and short requests of its kind alone
    (level 0), then each level for every workload."""
    out = [(2, "mixed"), (0, "mixed")] if "mixed" in args.workloads else []
    return out + [(level, w) for level in sorted(args.levels) for w in args.workloads if w != "mixed"]


def start_servers(args: argparse.Namespace, logs: Path, servers: list[Server],
                  engine: bool, on: dict) -> tuple[list[Mode], list[str]]:
    """Start the peer and every mode the worker supports (into ``servers``; ``on``: the SpecPrefill
    modes' request fields): (those modes, a line for each mode skipped)."""
    servers.append(start_peer(logs))
    modes, skipped = [], []
    for mode in service_modes(args.in_flight):
        if mode.batching and not engine:
            skipped.append(f"{mode.name}: skipped: engine not present (the worker has no --max-jobs-in-flight)")
            continue
        servers.append(start_service(mode, logs, engine, on=on))
        modes.append(mode)
    return modes, skipped


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    texts = Texts(QUICK if args.quick else Sizes())
    on = QUICK_SPECPREFILL_ON if args.quick else SPECPREFILL_ON
    logs = Path(tempfile.mkdtemp(prefix="bench-load-"))
    slos = tuple(sorted({*args.slo_ttft, args.agent_slo_ttft}))
    run, servers = Run(deadline=time.monotonic() + 60 * args.max_minutes, slos=slos), []
    engine = engine_present()
    try:
        modes, skipped_modes = start_servers(args, logs, servers, engine, on)
        print(f"servers: {', '.join(s.name for s in servers)} (logs in {logs})", flush=True)
        for level, workload in schedule(args):  # level by level: a bound cuts the highest levels first
            measure(run, servers, texts, workload, level, args.seed + 1000 * WORKLOADS.index(workload) + level)
        loaded = sorted({int(level) for _, level in run.requests if int(level) > 1}, key=lambda lv: abs(lv - TARGET_LEVEL))
        if loaded:  # the level nearest the targets' that ran under load
            alone_check(run, modes, loaded[0], logs, engine, on)
    finally:
        for server in servers:
            server.stop()
    print_table(run)
    for line in skipped_modes + [f"skipped (--max-minutes): {w}" for w in run.skipped]:
        print(line)
    print(f"waited {run.settled:.0f} s in all for the servers' leftover work (heals) before runs")
    names = [s.name for s in servers]
    source = "batching+SpecPrefill" if "batching+SpecPrefill" in names else "in-flight 1"
    note = "" if source == "batching+SpecPrefill" else "; from in-flight 1: engine not present"
    print(f"SpecPrefill on: {on} per request; off: every prompt prefilled whole; "
          f"targets from {source}")
    return report([], targets(run, source, note, args.agent_slo_ttft))


if __name__ == "__main__":
    sys.exit(main())
