"""The load client of ``bench/load.py``: streamed OpenAI chat completions over loopback (the
``openai`` SDK, async), one record per request, and the figures ``vllm bench serve`` reports,
under its names.

A request's times are the client's: TTFT is from sending it to the first chunk with text, each
inter-token latency (ITL) the gap between two chunks with text as they arrive (a server that
sends several tokens in one chunk shows one long gap, not several short ones), TPOT a request's
(E2EL - TTFT) / (output tokens - 1), E2EL from sending to the stream's end. Output tokens are
the server's own count (``stream_options.include_usage``).
"""
from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import openai

REQUEST_TIMEOUT_S = 900.0  # one request's bound: a stuck server fails its requests, not the run


@dataclass
class Record:
    """One request as the client saw it (``perf_counter`` seconds)."""

    key: str  # names the request across servers and runs (its prompt)
    sent: float
    first: float | None = None  # the first chunk with text
    chunks: list[float] = field(default_factory=list)  # arrival of every chunk with text
    done: float | None = None
    text: str = ""
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.done is not None and self.first is not None

    @property
    def ttft(self) -> float:
        return self.first - self.sent

    @property
    def e2el(self) -> float:
        return self.done - self.sent

    @property
    def tpot(self) -> float | None:
        return (self.e2el - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:])]


def client(base_url: str) -> openai.AsyncOpenAI:
    """An async client of one server (no retries: a failed request is a failed request)."""
    return openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT_S)


def _read_chunk(record: Record, chunk: Any) -> None:
    if chunk.usage:
        record.output_tokens = int(chunk.usage.completion_tokens or 0)
        record.prompt_tokens = int(chunk.usage.prompt_tokens or 0)
    for choice in chunk.choices or []:
        text = choice.delta.content if choice.delta else None
        if text:
            now = time.perf_counter()
            record.first = record.first or now
            record.chunks.append(now)
            record.text += text


async def stream_chat(sdk: openai.AsyncOpenAI, body: dict[str, Any], key: str) -> Record:
    """One streamed chat completion; its record (``error`` set instead of raising)."""
    record = Record(key, time.perf_counter())
    try:
        stream = await sdk.chat.completions.create(**body, stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            _read_chunk(record, chunk)
        record.done = time.perf_counter()
    except openai.OpenAIError as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    return record


async def closed_loop(calls: list[Callable[[], Awaitable[Record]]], concurrency: int) -> list[Record]:
    """Run ``calls`` with at most ``concurrency`` in flight (``vllm bench serve --max-concurrency``
    at an unbounded request rate): each client sends its next request when its last one ends."""
    gate = asyncio.Semaphore(concurrency)

    async def one(call: Callable[[], Awaitable[Record]]) -> Record:
        async with gate:
            return await call()

    return list(await asyncio.gather(*(one(c) for c in calls)))


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (linear interpolation, numpy's default); None without values."""
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    ranked = sorted(values)
    pos = (len(ranked) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ranked) - 1)
    return ranked[lo] + (ranked[hi] - ranked[lo]) * (pos - lo)


def goodput_name(slo_ttft_s: float) -> str:
    """The summary's key of goodput at one TTFT SLO (``goodput@2s``)."""
    return f"goodput@{slo_ttft_s:g}s"


def summarize(records: list[Record], slos_ttft_s: tuple[float, ...]) -> dict[str, Any]:
    """``vllm bench serve``'s figures over one run: throughputs over the run's duration (first
    request sent to last stream ended), percentiles of the completed requests, and goodput at
    each TTFT SLO of ``slos_ttft_s`` (``goodput_name``): as ``vllm bench serve --goodput``
    counts it, the completed requests per second that met every SLO given (here one, TTFT)."""
    done = [r for r in records if r.ok]
    if not done:
        return {"completed": 0, "failed": len(records)}
    duration = max(r.done for r in done) - min(r.sent for r in records)
    out: dict[str, Any] = {
        "completed": len(done), "failed": len(records) - len(done), "duration": duration,
        "request_throughput": len(done) / duration,
        "output_throughput": sum(r.output_tokens for r in done) / duration,
        "mean_output_tokens": statistics.mean(r.output_tokens for r in done),
    }
    for slo in slos_ttft_s:
        out[goodput_name(slo)] = sum(r.ttft <= slo for r in done) / duration
    series = {"ttft": [r.ttft for r in done], "tpot": [t for r in done if (t := r.tpot) is not None],
              "itl": [gap for r in done for gap in r.itls], "e2el": [r.e2el for r in done]}
    for name, values in series.items():
        for q in (50, 99):
            out[f"p{q}_{name}"] = percentile(values, q)
    return out
