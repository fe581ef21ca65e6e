"""The SpecPrefill extension every API shares: the request's extra body fields (the draft
model and every generate option the API has no name for, ``extra_body={"keep": 0.2}`` in
the SDKs) and the reply's ``specprefill`` object (what SpecPrefill did for the answer)."""
from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, create_model

from jobs.contract.results import GenerateResult
from jobs.contract.spec import option_names

# Phases before the first token, in the order they run (GenerateResult.timings keys), for
# results of workers that do not report ``ttft_phases`` themselves.
TTFT_PHASES = ("load_models", "tokenize", "draft_scoring", "selection", "target_prefill")

# Fields of OpenAI's own that carry a generate job's options (each API's convert.py maps its own names).
OPENAI_OPTIONS = frozenset({"max_tokens", "temperature", "top_p", "seed", "stop"})
# The SpecPrefill knobs a request may set as extra body fields (unset: the deployment's
# settings): the draft model and every option of a generate job (jobs.contract.spec.option_names)
# OpenAI has no name for. Typed Any: the job spec checks each (its error names the field).
SPECPREFILL_FIELDS = ("draft_model", *(n for n in option_names("generate") if n not in OPENAI_OPTIONS))
SpecPrefillOptions = create_model(
    "SpecPrefillOptions", __config__=ConfigDict(extra="forbid"),
    **{name: (Any, None) for name in SPECPREFILL_FIELDS})


def job_fields(req: Any, **named: Any) -> dict[str, Any]:
    """A request's SpecPrefill extra fields and the job fields its API names (``target_model``,
    ``max_tokens``, ...), the unset ones left to the service's defaults. ``max_tokens`` is a
    ceiling, as the real APIs treat it (``fit_context``, unless the request turns it off): one
    above the deployment's ``max_generate_tokens`` is lowered to it, and the worker lowers it to
    the room the prompt leaves in the target's window (the answer ends with the length reason)."""
    fields: dict[str, Any] = {name: getattr(req, name) for name in SPECPREFILL_FIELDS}
    fields.update(named)
    if fields.get("fit_context") is None:
        fields["fit_context"] = True
    return {k: v for k, v in fields.items() if v is not None}


def draft_tokens_scored(result: GenerateResult) -> int:
    """Prompt tokens the draft prefilled to score this prompt (the worker's ``draft_scoring``
    count): its restored blocks not counted, 0 when it did not run (admission, a memo hit,
    ``full_prefill``, a fallback before scoring)."""
    return result.total - result.cached_tokens if result.draft_timings and not result.memo_hit else 0


def specprefill_info(result: GenerateResult) -> dict[str, Any]:
    """What SpecPrefill did for this answer, each count named by whose tokens it counts (the
    target's or the draft's) and how they came, so none is taken for another: the target's
    prompt tokens restored from the block store (``usage``'s cached tokens on every API), of
    them healed, prefilled in full, prefilled sparse, dropped; the draft's restored and scored."""
    target = result.target_tokens
    return {
        "job_id": result.job_id,
        "prompt_tokens": result.total,
        "target_tokens_restored": result.restored,
        "target_tokens_healed": int(target.get("healed", 0)),
        "target_tokens_prefilled_full": int(target.get("prefilled_full", 0)),
        "target_tokens_prefilled_sparse": int(target.get("prefilled_sparse", 0)),
        "target_tokens_dropped": result.total - result.kept,
        "target_blocks_written": int(target.get("blocks_written", 0)),
        "draft_tokens_restored": result.cached_tokens,
        "draft_tokens_scored": draft_tokens_scored(result),
        "kept_ratio": round(result.ratio, 6),  # of the tokens not restored (what was selected over)
        "restored_ratio": round(result.restored_ratio, 6),
        "protected_prefix_tokens": result.protected_prefix,
        "memo_hit": result.memo_hit,
        "full_prefill": result.full_prefill,
        "reason": result.reason,
        "keep_effect": result.keep_effect,  # why more was kept than keep asked for, if it was
        "fallback": result.fallback,
        "heal": dict(result.heal or {}),  # this turn's heal job (queued, its id) or why none
        "warnings": list(result.warnings),
        "ttft_s": result.ttft_s,
        "ttft_phases_s": dict(result.ttft_phases) or {p: result.timings[p] for p in TTFT_PHASES
                                                      if p in result.timings},
        "draft_phases_s": dict(result.draft_timings),
    }
