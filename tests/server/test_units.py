"""The server's pure parts: request conversion, batch lines, errors, the job view's
segments and bands, the importance SVG (no server, no Redis)."""
from __future__ import annotations

import json

import pytest

from jobs.contract.layout import Region, layout, regions
from jobs.contract.results import GenerateResult
from jobs.contract.results import ImportanceCurve, PrefillResult
from jobs.contract.spec import JobSpecError, build_spec
from jobs.settings import Settings
from specprefill_server.apis.openai.convert import chat_fields, chat_messages, completion_fields
from specprefill_server.apis.openai.reply import ChunkMaker
from specprefill_server.apis.openai.types import ChatCompletionRequest, CompletionRequest
from specprefill_server.batch.lines import plan_lines, result_lines
from specprefill_server.errors import APIError, from_job_failure, from_spec_error
from specprefill_server.parse import parse
from specprefill_server.web.jobview import segments
from specprefill_server.web.svg import importance_svg


def generate_spec(**fields):
    return build_spec(Settings(), kind="generate", **fields)


def result(**kw) -> GenerateResult:
    base = dict(job_id="generate-abc", text="hi", finish_reason="eos", token_ids=[5, 6], ttft_s=0.1,
                kept=40, total=100, kept_ranges=[(0, 40)], timings={"draft_scoring": 0.01, "decode": 0.2})
    return GenerateResult(**{**base, **kw})


def test_chat_request_maps_to_generate_fields():
    req = parse(ChatCompletionRequest, {
        "model": "target", "messages": [{"role": "system", "content": "s"},
                                        {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                     {"type": "text", "text": "b"}]}],
        "max_completion_tokens": 7, "temperature": 0, "seed": 4, "stop": "x", "keep": 0.3,
        "tools": [{"type": "function", "function": {"name": "f"}}], "user": "u"})
    fields = chat_fields(req)
    assert fields == {"target_model": "target", "messages": req.messages,
                      "max_tokens": 7, "temperature": 0, "seed": 4, "stop": "x", "keep": 0.3,
                      "tools": [{"type": "function", "function": {"name": "f"}}],
                      "fit_context": True}  # max_tokens is a ceiling, as OpenAI's is
    spec = generate_spec(**fields)
    assert spec.messages[1] == {"role": "user", "content": "ab"}  # text parts joined by the spec
    kwargs = chat_fields(parse(ChatCompletionRequest, {
        "model": "t", "messages": [{"role": "user", "content": "a"}],
        "chat_template_kwargs": {"enable_thinking": False}}))
    assert kwargs["template_args"] == {"enable_thinking": False}
    assert spec.tools[0]["function"]["name"] == "f" and spec.generate.max_tokens == 7


def test_every_job_option_is_a_request_field():
    from jobs.contract.spec import option_names
    from specprefill_server.extension import OPENAI_OPTIONS, SPECPREFILL_FIELDS

    assert set(option_names("generate")) <= set(SPECPREFILL_FIELDS) | OPENAI_OPTIONS
    req = parse(ChatCompletionRequest, {"model": "t", "messages": [{"role": "user", "content": "a"}],
                                        "lookahead_seed": 5, "seed": 2, "pool_kernel": 3, "full_prefill": True})
    spec = generate_spec(**chat_fields(req))
    assert (spec.scoring.seed, spec.generate.seed, spec.scoring.pool_kernel) == (5, 2, 3)
    assert spec.generate.full_prefill
    with pytest.raises(JobSpecError, match="^pool_kernel: expected an integer"):  # checked once, by the spec
        generate_spec(**chat_fields(parse(ChatCompletionRequest, {
            "model": "t", "messages": [{"role": "user", "content": "a"}], "pool_kernel": "3"})))


def test_unsupported_request_fields_are_refused_by_name():
    for body, param in [({"n": 3}, "n"), ({"logprobs": True}, "logprobs"), ({"kepp": 1}, "kepp"),
                        ({"presence_penalty": 0.5}, "presence_penalty"),
                        ({"response_format": {"type": "json_object"}}, "response_format"),
                        ({"stream_options": {"include_usage": True}}, "stream_options"),
                        ({"temperature": "warm"}, "temperature"), ({"stream": 5}, "stream")]:
        with pytest.raises(APIError) as err:
            parse(ChatCompletionRequest, {"model": "m", "messages": [], **body})
        assert err.value.status == 400 and err.value.param == param, (body, err.value.body())
    for messages, param in [([{"role": "user", "content": "x", "tool_call_id": "c"}], "messages[0].tool_call_id"),
                            ([{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": []}],
                             "messages[1].content"),
                            ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}],
                             "messages[0].content[0]")]:
        with pytest.raises(JobSpecError) as err:
            generate_spec(**chat_fields(parse(ChatCompletionRequest, {"model": "t", "messages": messages})))
        assert from_spec_error(err.value).param == param, str(err.value)


def test_openai_tool_conversations_convert_to_the_conversation_format():
    replayed = {"role": "assistant", "content": None, "refusal": None, "audio": None, "function_call": None,
                "annotations": [], "reasoning": "look it up",
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"k": [1, 2]}'}},
                               {"id": "c2", "type": "function", "function": {"name": "f", "arguments": ""}}]}
    out = chat_messages([{"role": "user", "content": "q", "name": "bob"}, replayed,
                         {"role": "tool", "tool_call_id": "c1", "content": "r"}])
    assert out[1] == {"role": "assistant", "content": None, "reasoning_content": "look it up",
                      "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"k": [1, 2]}}},
                                     {"id": "c2", "type": "function", "function": {"name": "f", "arguments": {}}}]}
    spec = generate_spec(**chat_fields(parse(ChatCompletionRequest, {"model": "t", "messages": [
        {"role": "user", "content": "q", "name": "bob"}, replayed, {"role": "tool", "tool_call_id": "c1", "content": "r"}]})))
    assert spec.messages[1]["tool_calls"][0]["function"]["arguments"] == {"k": [1, 2]}
    with pytest.raises(APIError) as err:
        chat_messages([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{oops"}}]}])
    assert err.value.param == "messages[0].tool_calls[0].function.arguments" and "not valid JSON" in err.value.message


def test_tool_call_results_and_chunks_in_openai_form():
    from jobs.client.answer_stream import Finish, ReasoningDelta, ToolCallArguments, ToolCallStart, Usage
    from specprefill_server.apis.openai.reply import chat_completion

    res = result(text="", reasoning="hmm", finish_reason="tool_calls",
                 tool_calls=[{"id": "abc123def", "name": "lookup", "arguments": {"key": "alpha"}}])
    choice = chat_completion(res, model="m", created=1)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {"role": "assistant", "content": None, "reasoning_content": "hmm", "tool_calls": [
        {"id": "abc123def", "type": "function", "function": {"name": "lookup", "arguments": '{"key": "alpha"}'}}]}
    maker = ChunkMaker(chat=True, job_id="generate-abc", model="m", created=1)
    assert maker.event(ReasoningDelta("hm"))["choices"][0]["delta"] == {"reasoning_content": "hm"}
    assert maker.event(ToolCallStart(0, "abc123def", "lookup"))["choices"][0]["delta"] == {"tool_calls": [
        {"index": 0, "id": "abc123def", "type": "function", "function": {"name": "lookup", "arguments": ""}}]}
    assert maker.event(ToolCallArguments(0, '{"key"'))["choices"][0]["delta"] == {
        "tool_calls": [{"index": 0, "function": {"arguments": '{"key"'}}]}
    assert maker.event(Finish("tool_calls", Usage(1, 1), res)) is None
    assert maker.last(res)["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}


def test_completion_prompts():
    assert completion_fields(parse(CompletionRequest, {"model": "m", "prompt": ["one"]}))["text"] == "one"
    assert completion_fields(parse(CompletionRequest, {"model": "m", "prompt": [1, 2]}))["tokens"] == [1, 2]
    assert completion_fields(parse(CompletionRequest, {"model": "m", "prompt": "p"}))["max_tokens"] == 16
    with pytest.raises(APIError) as err:
        completion_fields(parse(CompletionRequest, {"model": "m", "prompt": ["a", "b"]}))
    assert err.value.param == "prompt"


def test_spec_errors_use_the_request_names():
    err = from_spec_error(JobSpecError("target_model: 'x' is not an allowed model"))
    assert err.param == "model" and err.message.startswith("model: ")
    worker = from_job_failure("failed", "jobs.contract.spec.JobSpecError: input: 200000 tokens, the limit is 131072")
    assert worker.status == 400 and worker.param == "input"
    model = from_job_failure("failed", "ValueError: target_model: '/x' is neither a model folder nor ...")
    assert model.status == 400 and model.param == "model"
    bug = from_job_failure("failed", "ValueError: something broke")
    assert bug.status == 500
    assert from_job_failure("stopped", "stopped").code == "job_stopped"


def test_chunks_carry_role_text_finish_and_usage():
    maker = ChunkMaker(chat=True, job_id="generate-abc", model="m", created=1)
    assert maker.first()["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert maker.text("he")["choices"][0]["delta"] == {"content": "he"}
    last = maker.last(result())
    assert last["choices"][0]["finish_reason"] == "stop" and last["specprefill"]["kept_ratio"] == 0.4
    assert maker.usage(result(target_tokens={"restored": 64}))["usage"] == {
        "prompt_tokens": 100, "completion_tokens": 2, "total_tokens": 102,
        "prompt_tokens_details": {"cached_tokens": 64}}  # what the target restored, as Messages and Responses say
    assert ChunkMaker(chat=False, job_id="generate-abc", model="m", created=1).first() is None


def test_the_specprefill_object_names_whose_tokens_each_count_is():
    from specprefill_server.extension import specprefill_info

    info = specprefill_info(result(kept=70, cached_tokens=30, draft_timings={"prefill": 0.1}, target_tokens={
        "restored": 40, "healed": 8, "prefilled_full": 10, "prefilled_sparse": 20, "blocks_written": 2}))
    assert {k: v for k, v in info.items() if "tokens" in k and not k.endswith("_s")} == {
        "prompt_tokens": 100, "target_tokens_restored": 40, "target_tokens_healed": 8,
        "target_tokens_prefilled_full": 10, "target_tokens_prefilled_sparse": 20, "target_tokens_dropped": 30,
        "draft_tokens_restored": 30, "draft_tokens_scored": 70, "protected_prefix_tokens": 0}
    assert info["target_blocks_written"] == 2
    assert specprefill_info(result(memo_hit=True, draft_timings={"prefill": 0.1}))["draft_tokens_scored"] == 0
    assert specprefill_info(result())["draft_tokens_scored"] == 0  # the draft did not run


def line(custom_id, **body):
    body = {"model": "t", "messages": [{"role": "user", "content": "hello"}], **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


def test_batch_lines_plan_and_results():
    content = "\n".join([line("a"), "", "[1]", line("b", keep=9), line("a"), line("c", stream=True),
                         line("d", max_tokens=3)])
    entries, specs = plan_lines(content, generate_spec, "ns", "/v1/chat/completions")
    assert [(e.line, e.custom_id, bool(e.job_id)) for e in entries] == [
        (1, "a", True), (3, None, False), (4, "b", False), (5, "a", False), (6, "c", False), (7, "d", True)]
    assert len(specs) == 2 and entries[0].job_id == specs[0].job_id("ns")
    assert [e.error["param"] for e in entries if e.error] == ["line", "keep", "custom_id", "stream"]
    outcomes = {entries[0].job_id: result(job_id=entries[0].job_id), entries[-1].job_id: ("failed", "boom")}
    out, errors = result_lines(entries, outcomes, created=5)
    assert [o["custom_id"] for o in out] == ["a"]
    assert out[0]["response"]["body"]["choices"][0]["message"]["content"] == "hi"
    assert [e["custom_id"] for e in errors] == [None, "b", "a", "c", "d"]
    assert errors[-1]["response"]["status_code"] == 500 and errors[0]["response"] is None
    again, _ = result_lines(entries, outcomes, created=5)
    assert again == out  # ids are stable: finalising twice writes the same file


def test_segments_align_unique_spans_and_refuse_repeats():
    doc = "alpha beta gamma delta epsilon zeta eta theta"
    spans = [{"start": 0, "end": 2, "text": "<s> alpha beta"}, {"start": 5, "end": 6, "text": "zeta"}]
    segs, aligned = segments(8, [(0, 2), (5, 6)], spans=spans, document=doc,
                             regions=layout(8, [(0, 2), (5, 6)], tail_start=5))
    assert aligned
    assert [(s.kind, s.text, s.marks) for s in segs] == [
        ("kept", "alpha beta", []), ("dropped", " gamma delta epsilon ", []), ("kept", "zeta", ["tail"]),
        ("dropped", " eta theta", [])]  # the tail region holds kept tokens only
    # a kept passage that occurs twice: which copy was kept is unknown, so no text is placed
    doc2 = "x y kept words z kept words w"
    segs, aligned = segments(8, [(2, 4)], spans=[{"start": 2, "end": 4, "text": "kept words"}], document=doc2)
    assert not aligned and [(s.kind, s.text) for s in segs] == [
        ("dropped", None), ("kept", "kept words"), ("dropped", None)]


def test_layout_splits_every_region_kind_exactly():
    assert [(r.kind, r.start, r.end) for r in layout(100, [(0, 40), (60, 100)], protected_prefix=10,
                                                     tail_start=80)] == [
        ("prefix", 0, 10), ("kept", 10, 40), ("dropped", 40, 60), ("kept", 60, 80), ("tail", 80, 100)]
    # a restored prefix longer than the system block, a healed part of a dropped range
    assert [(r.kind, r.start, r.end) for r in layout(100, [(0, 40), (60, 100)], protected_prefix=10,
                                                     tail_start=80, restored=32, healed_ranges=[(40, 50)])] == [
        ("restored", 0, 32), ("kept", 32, 40), ("healed", 40, 50), ("dropped", 50, 60), ("kept", 60, 80),
        ("tail", 80, 100)]
    # a restored prefix part of which a heal made (a generate job's healed_ranges)
    assert [(r.kind, r.start, r.end) for r in layout(100, [(0, 100)], protected_prefix=10, restored=64,
                                                     healed_ranges=[(32, 64)])] == [
        ("restored", 0, 32), ("healed", 32, 64), ("kept", 64, 100)]
    result = PrefillResult(job_id="j", kept=60, total=100, kept_ranges=[(0, 40), (80, 100)],
                           protected_prefix=5, tail_start=90)
    assert regions(result) == [Region("prefix", 0, 5), Region("kept", 5, 40), Region("dropped", 40, 80),
                               Region("kept", 80, 90), Region("tail", 90, 100)]


def test_segments_are_marked_with_the_regions_they_hold():
    doc = "aa bb cc dd"
    spans = [{"start": 0, "end": 2, "text": "aa bb"}]
    segs, aligned = segments(4, [(0, 2)], spans=spans, document=doc,
                             regions=layout(4, [(0, 2)], restored=1, healed_ranges=[(2, 4)]))
    assert aligned and [(s.kind, s.text, s.marks) for s in segs] == [
        ("kept", "aa bb", ["restored"]), ("dropped", " cc dd", ["healed"])]


def test_importance_curve_keeps_peaks_and_the_svg_draws_its_bins():
    values = [0.0] * 5000
    values[1234] = 1.0
    curve = ImportanceCurve.of(values, 800)
    assert curve.tokens_per_bin == 7 and len(curve.max) == 715 and max(curve.max) == 1.0
    assert curve.max.index(1.0) == 1234 // 7
    assert ImportanceCurve.of([0.5, 0.25], 800) == ImportanceCurve(1, [0.5, 0.25])
    bands = layout(5000, [(0, 100), (4900, 5000)], protected_prefix=50, tail_start=4968, restored=16)
    svg = importance_svg(curve, 5000, bands)
    assert svg.count('class="kept"') == 2 and 'class="prefix"' in svg and 'class="tail"' in svg
    assert 'class="restored"' in svg and 'class="dropped"' not in svg
    assert "max importance per 7 tokens" in svg and 'data-tokens="5000"' in svg


def test_worker_metrics_count_what_results_report():
    from prometheus_client import CollectorRegistry

    from worker.process.metrics import WorkerMetrics

    registry = CollectorRegistry()
    m = WorkerMetrics(registry)
    m.job_ended("generate", "finished", 0.5, {"total": 1000, "cached_tokens": 256, "kept": 300,
                                              "generated_tokens": 7, "ttft_s": 0.2, "blocks_written": 2,
                                              "draft_model": "local:d"})
    # answered without the draft (admission, here after restoring 200 tokens): no draft tokens
    m.job_ended("generate", "finished", 0.5, {"total": 250, "kept": 250, "draft_model": "",
                                              "target_tokens": {"restored": 200}, "fallback": "fallback: x"})
    m.job_ended("prefill", "finished", 0.1, {"total": 500, "cached_tokens": 500, "memo_hit": True})
    m.job_ended("generate", "failed", 0.05, None, queue_wait_s=1.5)
    value = registry.get_sample_value
    assert value("specprefill_worker_queue_wait_seconds_count", {"kind": "generate"}) == 1
    assert value("specprefill_worker_queue_wait_seconds_sum", {"kind": "generate"}) == 1.5
    assert value("specprefill_worker_kept_ratio_count", {"kind": "generate"}) == 2  # finished ones
    assert value("specprefill_worker_kept_ratio_bucket", {"kind": "generate", "le": "0.3"}) == 1  # 300/1000
    assert value("specprefill_worker_jobs_total", {"kind": "generate", "status": "finished"}) == 2
    assert value("specprefill_worker_jobs_total", {"kind": "generate", "status": "failed"}) == 1
    assert value("specprefill_worker_draft_tokens_prefilled_total") == 744  # the memo hit computed none
    assert value("specprefill_worker_target_tokens_prefilled_total") == 350
    assert value("specprefill_worker_target_prefix_restored_tokens_total") == 200
    assert value("specprefill_worker_fallbacks_total", {"kind": "generate"}) == 1
    assert value("specprefill_worker_block_store_hit_tokens_total") == 756
    assert value("specprefill_worker_memo_hits_total") == 1
    assert value("specprefill_worker_ttft_seconds_count") == 2
    assert value("specprefill_worker_busy_seconds_total") == pytest.approx(1.15)


def test_served_models_lists_defaults_preloads_and_loaded():
    from types import SimpleNamespace

    from worker.process.advertise import served_models

    settings = Settings(draft_model="d", target_model="t", preload_models=("p",), allowed_models=("a",))
    runtime = SimpleNamespace(settings=settings, models=SimpleNamespace(names=lambda: ["t", "x"], loaded=lambda n: None))
    assert served_models(runtime) == [  # names jobs use: "t" is loaded as "target"
        {"name": "draft", "roles": ["default_draft"], "loaded": False},
        {"name": "target", "roles": ["default_target"], "loaded": True},
        {"name": "p", "roles": [], "loaded": False}, {"name": "a", "roles": [], "loaded": False},
        {"name": "x", "roles": [], "loaded": True}]
    # a worker's folders are never advertised; aliases are, by name
    settings = Settings(models=("q=/srv/q",), preload_models=("/srv/other",))
    runtime = SimpleNamespace(settings=settings, models=SimpleNamespace(names=lambda: ["/srv/q"], loaded=lambda n: None))
    assert [(m["name"], m["loaded"]) for m in served_models(runtime)] == [
        ("draft", False), ("target", False), ("q", True)]


def test_served_models_carry_the_window_their_config_declares(tmp_path):
    from types import SimpleNamespace

    from worker.process.advertise import served_models
    from worker.context_window import ContextWindow

    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 4096, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}}))
    loaded = SimpleNamespace(name="t", context=ContextWindow(2048, "max_position_embeddings 2048"))
    settings = Settings(draft_model=str(folder), target_model="t", models=(f"m={folder}",))
    runtime = SimpleNamespace(settings=settings, models=SimpleNamespace(
        names=lambda: ["t"], loaded=lambda name: loaded if name == "t" else None))
    windows = {m["name"]: m.get("context_window") for m in served_models(runtime)}
    # read from the folder's config without loading it (yarn: 4096 x 4), or the loaded model's own
    assert windows == {"draft": 16384, "target": 2048, "m": 16384}


# ---- the front door (issue 24, item 5) ----

UNASKED = {"user": "u", "safety_identifier": "h", "prompt_cache_key": "conv-7", "metadata": {"k": "v"},
           "service_tier": "auto", "verbosity": "low", "modalities": ["text"], "parallel_tool_calls": False,
           "stream": True, "stream_options": {"include_usage": True, "include_obfuscation": True}}


def test_fields_clients_send_unasked_change_nothing():
    base = {"model": "target", "messages": [{"role": "user", "content": "a"}], "stream": True}
    assert chat_fields(parse(ChatCompletionRequest, {**base, **UNASKED})) == \
        chat_fields(parse(ChatCompletionRequest, base))
    # reasoning_effort is the template's to read (gpt-oss has the switch; others ignore it)
    fields = chat_fields(parse(ChatCompletionRequest, {**base, "reasoning_effort": "high",
                                                       "chat_template_kwargs": {"enable_thinking": False}}))
    assert fields["template_args"] == {"enable_thinking": False, "reasoning_effort": "high"}


def test_every_error_has_a_code():
    cases = [({"kepp": 1}, "kepp", "unknown_parameter"), ({"temperature": "warm"}, "temperature", "invalid_type"),
             ({"n": 2}, "n", "unsupported_value"), ({"modalities": ["audio"]}, "modalities", "unsupported_value"),
             ({"verbosity": "loud"}, "verbosity", "invalid_value"), ({"audio": {}}, "audio", "unsupported_parameter"),
             ({"tool_choice": "required"}, "tool_choice", "unsupported_value"),
             ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "unsupported_value")]
    for body, param, code in cases:
        with pytest.raises(APIError) as err:
            parse(ChatCompletionRequest, {"model": "m", "messages": [], **body})
        assert (err.value.param, err.value.code) == (param, code), err.value.body()
    with pytest.raises(APIError) as err:
        parse(ChatCompletionRequest, {"model": "m"})
    assert (err.value.param, err.value.code) == ("messages", "missing_required_parameter")
    assert from_spec_error(JobSpecError("keep: 2 is outside")).code == "invalid_value"
    assert APIError(500, "x").code == "internal_error" and APIError(418, "x").code == "error"
    target = from_job_failure("failed", "jobs.contract.model_names.UnknownModelError: target_model: 'x': is a hub model not "
                                        "downloaded on this worker")
    assert (target.status, target.param, target.code) == (404, "model", "model_not_found")
    assert target.message.startswith("model: 'x'")
    draft = from_job_failure("failed", "jobs.contract.model_names.UnknownModelError: draft_model: 'd': its folder is missing")
    assert (draft.status, draft.param, draft.code) == (400, "draft_model", "model_not_found")


BAD_OPTIONS = [("keep", 0), ("keep", 1.5), ("threshold", -1), ("tail_tokens", -1), ("chunk_size", 0),
               ("n_lookahead", 300), ("pool_kernel", -1), ("pool_kernel", 5000), ("include_last_query", 5),
               ("full_prefill", 5), ("greedy", 5), ("draft_model", ""), ("draft_model", "x" * 2000),
               ("draft_model", "a\nb"), ("follow_chunks", -1), ("follow_chunks", 65), ("follow_chunks", 1.5)]


def test_follow_chunks_is_an_extra_body_field_of_the_job():
    import fakeredis

    from jobs.client import Client

    body = {"model": "target", "messages": [{"role": "user", "content": "a"}], "follow_chunks": 3, "keep": 0.1}
    spec = Client(fakeredis.FakeRedis(), Settings()).generate_spec(**chat_fields(parse(ChatCompletionRequest, body)))
    assert (spec.selection.follow_chunks, spec.selection.keep) == (3, 0.1)
    assert spec.to_payload()["selection"]["follow_chunks"] == 3


@pytest.mark.parametrize("name,bad", BAD_OPTIONS)
def test_every_specprefill_option_is_checked_at_the_door(name, bad):
    """A bad SpecPrefill option is a 400 naming it before any job exists (the pydantic
    model or the spec's own validation), never a job that runs without SpecPrefill."""
    import fakeredis

    from jobs.client import Client

    body = {"model": "target", "messages": [{"role": "user", "content": "a"}], name: bad}
    with pytest.raises((APIError, JobSpecError)) as err:
        Client(fakeredis.FakeRedis(), Settings()).generate_spec(**chat_fields(parse(ChatCompletionRequest, body)))
    error = err.value if isinstance(err.value, APIError) else from_spec_error(err.value)
    assert error.status == 400 and error.param == name and error.code, error.body()


def test_request_deadline_takes_the_shorter_of_server_and_sdk():
    from specprefill_server.deadline import request_deadline

    s = Settings(http_request_timeout_s=30, http_sdk_timeout_share=0.9)
    assert request_deadline({}, s, stream=False).seconds == 30
    js = request_deadline({"x-stainless-timeout": "10"}, s, stream=False)
    assert js.seconds == 9 and "x-stainless-timeout" in js.source
    assert request_deadline({"x-stainless-read-timeout": "600.0"}, s, stream=False).seconds == 30
    assert request_deadline({"x-stainless-timeout": "10"}, s, stream=True).seconds == 30  # headers go at once
    assert request_deadline({"x-stainless-timeout": "soon"}, s, stream=False).seconds == 30
    assert request_deadline({"x-stainless-read-timeout": "5"}, Settings(http_request_timeout_s=0),
                            stream=False).seconds == 4.5
    assert request_deadline({}, Settings(http_request_timeout_s=0), stream=False).seconds is None


def test_live_models_serve_what_they_list_or_any_name_when_open():
    from specprefill_server.availability import LiveModels

    closed = LiveModels("q", 2, frozenset({"draft", "target"}), accepts_unlisted=False)
    assert closed.serves("target") and not closed.serves("org/model")
    assert closed.serves("/srv/models/m")  # folders are never listed: the worker decides
    assert LiveModels("q", 1, frozenset(), accepts_unlisted=True).serves("org/model")
    nobody = LiveModels("q", 0, frozenset(), accepts_unlisted=False)
    assert not nobody.serves("target") and not nobody.serves("/srv/models/m")


def test_server_metrics_count_answers_of_every_mode():
    import fakeredis

    from specprefill_server.metrics import ServerMetrics

    m = ServerMetrics(fakeredis.FakeRedis(), fakeredis.FakeRedis(), Settings())
    timed = result(timings={"queue_wait": 0.3, "decode": 0.1})
    m.answered("/v1/chat/completions", timed, started=0.0, mode="sync")
    m.answered("/v1/chat/completions", result(), started=0.0, mode="stream")
    m.answered_in_batch("/v1/completions", result(kept=100, kept_ranges=[(0, 100)]))
    v = m.registry.get_sample_value
    for endpoint, mode in (("/v1/chat/completions", "sync"), ("/v1/chat/completions", "stream"),
                           ("/v1/completions", "batch")):
        assert v("specprefill_http_answers_total", {"endpoint": endpoint, "mode": mode}) == 1
    assert v("specprefill_http_ttft_seconds_count") == 3 and v("specprefill_http_prompt_tokens_total") == 300
    assert v("specprefill_http_job_duration_seconds_count", {"endpoint": "/v1/chat/completions"}) == 2
    assert v("specprefill_http_queue_wait_seconds_count") == 1 and v("specprefill_http_queue_wait_seconds_sum") == 0.3
    assert v("specprefill_http_kept_ratio_bucket", {"le": "0.4"}) == 2 and v("specprefill_http_kept_ratio_count") == 3


def test_a_job_without_a_curve_says_why():
    from specprefill_server.web.data import curve_note

    base = dict(job_id="j", kept=10, total=10, kept_ranges=[(0, 10)])
    assert curve_note(PrefillResult(**base, importance_curve=ImportanceCurve(1, [0.0] * 10))) is None
    assert "selection memo" in curve_note(PrefillResult(**base, memo_hit=True))
    assert "threshold" in curve_note(PrefillResult(**base, reason="keep all: 10 tokens, not more than the threshold"))
    assert "skipped (draft: boom)" in curve_note(PrefillResult(**base, fallback="draft: boom", reason="draft: boom"))
    gen = GenerateResult(**base, text="", finish_reason="length", token_ids=[], ttft_s=0.1, full_prefill=True)
    assert "full prefill requested" in curve_note(gen)


def test_queue_depth_covers_node_and_heal_queues_labelled_by_kind():
    """Issue 27: routed jobs wait in node queues (``<queue>@<node>``) and heals in ``-heal``
    queues; specprefill_queue_depth shows each, its kind a label (only the shared queue before)."""
    import fakeredis
    from rq import Queue

    from specprefill_server.metrics import DeploymentCollector

    r = fakeredis.FakeRedis()
    s = Settings()
    waiting = {"specprefill": 1, "specprefill@node-a": 2, "specprefill@node-b": 0, "specprefill-heal": 3}
    for name, n in waiting.items():
        r.sadd(Queue.redis_queues_keys, Queue.redis_queue_namespace_prefix + name)
        for i in range(n):
            r.rpush(Queue.redis_queue_namespace_prefix + name, f"job-{name}-{i}")
    r.sadd(Queue.redis_queues_keys, Queue.redis_queue_namespace_prefix + "other@node-a")  # not this deployment's
    families = {f.name: f for f in DeploymentCollector(r, r, s).collect()}
    depth = {(m.labels["queue"], m.labels["kind"]): m.value for m in families["specprefill_queue_depth"].samples}
    assert depth == {("specprefill", "shared"): 1, ("specprefill@node-a", "node"): 2,
                     ("specprefill@node-b", "node"): 0, ("specprefill-heal", "heal"): 3}


def test_anthropic_models_page_follows_both_cursors():
    from specprefill_server.apis.anthropic.models import models_page
    from specprefill_server.errors import APIError

    listing = {"data": [{"id": f"m{i}", "created": 1_750_000_000, "specprefill": {}} for i in range(5)]}
    ids = lambda page: [e["id"] for e in page["data"]]  # noqa: E731
    assert ids(models_page(listing, {}, 4096)) == ["m0", "m1", "m2", "m3", "m4"]
    page = models_page(listing, {"limit": "2", "after_id": "m1"}, 4096)
    assert ids(page) == ["m2", "m3"] and page["has_more"] and (page["first_id"], page["last_id"]) == ("m2", "m3")
    page = models_page(listing, {"limit": "2", "before_id": "m3"}, 4096)
    assert ids(page) == ["m1", "m2"] and page["has_more"]
    page = models_page(listing, {"limit": "2", "before_id": "m1"}, 4096)
    assert ids(page) == ["m0"] and not page["has_more"]
    assert models_page(listing, {"after_id": "m4"}, 4096) == {"data": [], "has_more": False, "first_id": None,
                                                        "last_id": None}
    assert models_page(listing, {}, 4096)["data"][0]["created_at"] == "2025-06-15T15:06:40Z"
    for query, field in (({"limit": "0"}, "limit"), ({"limit": "x"}, "limit"), ({"after_id": "nope"}, "after_id"),
                         ({"after_id": "m1", "before_id": "m3"}, "before_id")):
        with pytest.raises(APIError) as err:
            models_page(listing, query, 4096)
        assert err.value.status == 400 and err.value.param == field
    # the window as Anthropic's ModelInfo says it, when the workers advertise one
    windowed = {"data": [{"id": "w", "created": 1_750_000_000, "specprefill": {}, "context_window": 65536}]}
    info = models_page(windowed, {}, 4096)["data"][0]
    assert (info["max_input_tokens"], info["max_tokens"]) == (65536, 4096)
