"""Batch = alone, per family as target: each job's first logits and greedy tokens in the engine's
decode batch equal the same job run alone (``generate_tokens``), sparse and full jobs together.

Four jobs of different lengths (two sparse, each kept token at its original position inside a
target session; two full) prefill in the same chunks alone and in the engine, then decode 10
greedy tokens. The first logits are the prefill's (bit-equal everywhere). The decode steps'
logits are bit-equal on CPU with MLX's bundled BLAS for the families in ``BIT_EQUAL`` (the batched
forward computes each row as alone: same matmuls per row, padded keys masked to exact zeros; a
system OpenBLAS multiplies a batch with blocked kernels that sum in another order than one row's,
so there they agree to float rounding, as on Metal); the others agree
to float rounding: windowed families (mlx-lm's ``BatchRotatingKVCache`` masks and rolls its
window differently), MLA (deepseek_v3: its latent attention is one matmul over the batch) and
ministral3 (its query factor is computed per sequence from the offset array). Families whose cache or forward cannot batch decode one at a time in the same loop
and say why (``batched`` False).
"""
from __future__ import annotations

from contextlib import ExitStack
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from specprefill.blas import blas_in_use
from specprefill.attention.target import required_tail, target_profile, target_session
from specprefill.options import Sampling
from specprefill.sparse import full_prefill, generate_tokens
from specprefill_testkit import families as F
from worker.engine import Engine, batched_decode
import worker.engine.batch as batch_module

STEPS = 10
CHUNK = 16
JOBS = ((40, False), (70, True), (23, False), (90, True))  # (prompt length, sparse)
BIT_EQUAL = {"llama", "llama_mha", "mistral", "qwen3", "phi3", "gemma2", "gpt2", "qwen3_5", "lfm2", "nemotron_h",
             "falcon_h1", "mamba2", "gpt_bigcode", "llama_kv4", "qwen3_5_kv4"}
ROUNDING = 1e-5  # relative to the largest logit, the windowed families
ROWS_ALONE = mx.default_device() == mx.cpu and blas_in_use() == "bundled reference BLAS"

CASES = {  # name: (family, overrides, kv_bits)
    "llama_mha": ("llama", dict(num_key_value_heads=4), None),  # dense, one KV head per query head
    "llama": ("llama", {}, None),  # GQA
    "mistral": ("mistral", {}, None),  # one KV head
    "qwen3": ("qwen3", {}, None),
    "phi3": ("phi3", {}, None),
    "deepseek_v3": ("deepseek_v3", {}, None),  # MLA: a latent cache
    "ministral3": ("ministral3", {}, None),  # a query factor from the position, one sliding layer
    "gpt2": ("gpt2", {}, None),  # learned position embeddings
    "gemma3_text": ("gemma3_text", {}, None),  # sliding-window layers
    "olmo3": ("olmo3", {}, None),
    "gpt_oss": ("gpt_oss", {}, None),  # sinks, sliding layers
    "gemma4_text": ("gemma4_text", {}, None),  # KV-shared layers, array offsets
    "qwen3_5": ("qwen3_5", {}, None),  # hybrid: Gated DeltaNet + attention
    "lfm2": ("lfm2", {}, None),  # hybrid: short-conv
    "nemotron_h": ("nemotron_h", {}, None),  # hybrid: Mamba-2
    "falcon_h1": ("falcon_h1", {}, None),  # hybrid: CacheList
    "mamba2": ("mamba2", {}, None),  # recurrent only: no positions at all
    "llama_kv4": ("llama", "kv", 4),  # quantized KV
    "qwen3_5_kv4": ("qwen3_5", "kv", 4),
    "gemma2": ("gemma2", {}, None),  # hand-written attention: cannot batch
    "gpt_bigcode": ("gpt_bigcode", {}, None),  # a scalar-offset position embedding: cannot batch
}
UNBATCHED = {"llama_kv4": "quantized KV", "qwen3_5_kv4": "quantized KV", "gemma2": "differs",
             "gpt_bigcode": "fails"}


@pytest.fixture(autouse=True)
def step_logits(monkeypatch):
    """Each batched step's logits per task name (the rows the batch samples from)."""
    seen: dict[str, list[np.ndarray]] = {}
    genuine = batch_module._sample_rows

    def spy(logits, seqs):
        for i, seq in enumerate(seqs):
            seen.setdefault(seq.task.name, []).append(np.array(logits[i].astype(mx.float32)))
        return genuine(logits, seqs)
    monkeypatch.setattr(batch_module, "_sample_rows", spy)
    return seen


def build(case: str):
    family, over, kv_bits = CASES[case]
    model = F.build(family, seed=3, **(F.for_kv_quantization(family) if over == "kv" else over))
    return model, target_profile(model, kv_bits=kv_bits, kv_group_size=32)


def prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, F.VOCAB - 1, n)]


def prefill(model, profile, tokens, sparse, stack):
    if sparse:
        tail = max(required_tail(profile), 1)
        keep = np.union1d(np.arange(0, len(tokens), 3), np.arange(max(0, len(tokens) - tail), len(tokens)))
        session = stack.enter_context(target_session(model, profile))
        return session.prefill(tokens, keep, prefill_step=CHUNK)
    return full_prefill(model, tokens, prefill_step=CHUNK, kv_bits=profile.kv_bits, kv_group_size=32)


def alone(model, profile, tokens, sparse):
    """Today's path: the job's first logits, its greedy tokens and each decode step's logits."""
    seen = []

    def recording(inputs, cache):
        out = model(inputs, cache=cache)
        seen.append(np.array(out[0, -1].astype(mx.float32)))
        return out

    with ExitStack() as stack:
        logits, cache, state = prefill(model, profile, tokens, sparse, stack)
        first = np.array(logits.astype(mx.float32))
        out = list(generate_tokens(recording, logits, cache, state, max_tokens=STEPS, sampling=Sampling(greedy=True)))
    return first, out, seen


def job(model, profile, tokens, sparse, info):
    def run():
        with ExitStack() as stack:
            logits, cache, state = prefill(model, profile, tokens, sparse, stack)
            first = np.array(logits.astype(mx.float32))
            out = list(batched_decode(model, cache, logits, sampling=Sampling(greedy=True), max_tokens=STEPS,
                                      stop_tokens=(), position=len(tokens), state=state, info=info))
        return first, out
    return run


@pytest.mark.parametrize("case", list(CASES))
def test_batch_equals_alone(case, step_logits):
    model, profile = build(case)
    prompts = [prompt(n, seed) for seed, (n, _) in enumerate(JOBS)]
    expected = [alone(model, profile, p, sparse) for p, (_, sparse) in zip(prompts, JOBS)]
    engine = Engine(max_decode_gap_s=0.05, prefill_chunk_tokens=CHUNK)
    infos = [{} for _ in JOBS]
    tasks = [engine.start(job(model, profile, p, sparse, info), name=str(i))
             for i, (p, (_, sparse), info) in enumerate(zip(prompts, JOBS, infos))]
    sizes = []
    while engine.step():
        sizes.append(engine.batch_size)
    for i, (task, (first, tokens, steps)) in enumerate(zip(tasks, expected)):
        assert task.exception is None, task.exception
        got_first, got_tokens = task.result
        assert np.array_equal(got_first, first), f"job {i}: first logits"
        assert got_tokens == tokens, f"job {i}: greedy tokens"
        if case in UNBATCHED:
            assert infos[i]["batched"] is False and UNBATCHED[case] in infos[i]["unbatched_reason"]
            continue
        assert infos[i] == {"batched": True, "unbatched_reason": None}
        rows = step_logits[str(i)]
        # a batch that runs ahead queued one step past the last token (nobody reads it)
        assert len(rows) in (STEPS - 1, STEPS)
        rows = rows[:STEPS - 1]
        for row, ref in zip(rows, steps):
            if case in BIT_EQUAL and ROWS_ALONE:
                assert np.array_equal(row, ref), f"job {i}: a decode step's logits"
            else:
                assert np.abs(row - ref).max() <= ROUNDING * np.abs(ref).max(), f"job {i}: a decode step's logits"
    assert max(sizes) == len(JOBS)  # all four decoded at once (batched, or each in its own turns)


def test_left_padding_and_offsets_follow_each_sequence():
    """A sparse sequence's RoPE offset is its true position (N), not its cache length (K)."""
    model, profile = build("llama")
    tokens = prompt(60, 9)
    with ExitStack() as stack:
        logits, cache, state = prefill(model, profile, tokens, True, stack)
        kept = cache[0].offset
    batch = batch_module.DecodeBatch(model)
    seq = batch_module.Sequence(None, Sampling(greedy=True), None, len(tokens), 5, cache, keep_cache=True)
    batch.join(seq)
    batch.logits()
    assert kept < len(tokens) and batch.cache[0].offset.tolist() == [len(tokens) + 1]  # after the step
    batch.leave(seq)
    assert cache[0].offset == kept + 1  # the cache came back with the fed token


@pytest.mark.parametrize("case, keep_cache, ahead", [("llama", True, True), ("gemma3_text", True, False),
                                                     ("mamba2", True, False), ("mamba2", False, True)])
def test_a_batch_runs_ahead_and_a_leaving_sequence_gets_back_what_it_fed(case, keep_cache, ahead):
    """The next step is queued before the tasks read this one's tokens, where the cache a leaving
    sequence takes back can be trimmed of the step it never read (KV only), or nobody takes it
    back; the cache it takes back equals the one it would have alone after feeding the same tokens."""
    model, profile = build(case)
    tokens = prompt(37, 4)
    logits, cache, _ = full_prefill(model, tokens, prefill_step=CHUNK)
    first = int(mx.argmax(logits.astype(mx.float32), axis=-1).item())
    _, alone_cache, _ = full_prefill(model, tokens, prefill_step=CHUNK)
    batch = batch_module.DecodeBatch(model)
    task = SimpleNamespace(name=case)  # what the step_logits spy reads
    seq = batch_module.Sequence(task, Sampling(greedy=True), None, len(tokens), first, cache, keep_cache=keep_cache)
    batch.join(seq)
    fed = [first]
    for _ in range(3):
        assert batch.step() == [seq]
        assert (batch._ahead is not None) == ahead
        fed.append(seq.token)
    batch.leave(seq)
    if not keep_cache:
        return
    model(mx.array([fed[:-1]], dtype=mx.int32), cache=alone_cache)  # alone: every token but the unread one
    if ahead:  # nothing past the offset: the state is what it holds
        assert all(c.offset == c.keys.shape[2] == len(tokens) + len(fed) - 1 for c in cache)
    last = mx.array([fed[-1:]], dtype=mx.int32)  # the next step, from each cache
    got, want = (np.array(model(last, cache=c)[0, -1].astype(mx.float32)) for c in (cache, alone_cache))
    assert np.abs(got - want).max() <= ROUNDING * np.abs(want).max()
