"""The draft and the target must share one tokenizer: SpecPrefill feeds the draft's token
ids to the target. Checked once per (draft, target) pair a worker loads."""
from __future__ import annotations

from typing import Any

from jobs.contract.spec import JobSpecError
from worker.models import LoadedModel
from worker.runtime import WorkerRuntime

TOKENIZER_PROBE = "Tokenizer probe: Hello, world! 0123456789 ({[ÄÖÜ é ß 漢字]}) -> done."


def check_pair_once(runtime: WorkerRuntime, draft: LoadedModel, target: LoadedModel) -> None:
    """:func:`check_shared_tokenizer` for a pair this worker has not checked yet."""
    pair = (draft.identity, target.identity)
    if pair not in runtime.tokenizer_pairs_checked:  # a vocabulary scan per pair, not per job
        check_shared_tokenizer(draft.tokenizer, target.tokenizer)
        runtime.tokenizer_pairs_checked.add(pair)


def check_shared_tokenizer(draft_tokenizer: Any, target_tokenizer: Any) -> None:
    """SpecPrefill feeds the draft's token ids to the target: their tokenizers must agree on
    a probe string, and every id both vocabularies hold must be the same token (ids only
    one of them holds, such as extra special tokens at the end, are allowed)."""
    a = list(draft_tokenizer.encode(TOKENIZER_PROBE, add_special_tokens=False))
    b = list(target_tokenizer.encode(TOKENIZER_PROBE, add_special_tokens=False))
    if a != b:
        raise JobSpecError("target_model: its tokenizer differs from the draft model's; "
                           "the draft and the target must share one tokenizer")
    draft_vocab, target_vocab = _vocab(draft_tokenizer), _vocab(target_tokenizer)
    if draft_vocab is None or target_vocab is None:
        return
    target_by_id = {i: tok for tok, i in target_vocab.items()}
    moved = [tok for tok, i in draft_vocab.items()
             if target_vocab.get(tok, i) != i or target_by_id.get(i, tok) != tok]
    if moved:
        raise JobSpecError(f"target_model: its tokenizer differs from the draft model's: {len(moved)} "
                           f"of {len(draft_vocab)} tokens have other ids or share an id with another "
                           f"token (e.g. {moved[0]!r:.40}); the draft and the target must share one tokenizer")


def _vocab(tokenizer: Any) -> dict[str, int] | None:
    get_vocab = getattr(tokenizer, "get_vocab", None)
    vocab = get_vocab() if callable(get_vocab) else None
    return vocab if isinstance(vocab, dict) else None
