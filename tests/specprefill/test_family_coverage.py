"""Every family the project claims (specprefill_testkit/family_coverage.py ``claims``, the table in
docs/families.md) is still served exactly by the serving path, and every other one is refused by
its real cause; a regression fails here."""
import mlx.core as mx
import pytest

from specprefill.errors import UnsupportedModelError
import specprefill_testkit.families as F
import specprefill_testkit.family_coverage as C

NAMES = list(F.FAMILIES)


@pytest.mark.parametrize("name", NAMES)
def test_claimed_draft(name):
    if "draft" not in C.claims(name):
        with pytest.raises(ValueError, match=C.DRAFT_REFUSED[name]):
            C.draft(name)
        return
    assert C.draft(name) == "ok"


@pytest.mark.parametrize("name", [n for n in NAMES if F.FAMILIES[n].kind in ("variant", "hybrid")
                                  and "draft bf16" in C.claims(n)])
def test_claimed_draft_bf16(name):
    assert C.draft(name, mx.bfloat16) == "ok"


@pytest.mark.parametrize("name", [n for n in NAMES if "kv4" in C.claims(n)])
def test_claimed_quantized_draft(name):
    assert C.draft(name, kv_bits=4) == "ok"


@pytest.mark.parametrize("name", [n for n in NAMES if "kv4" not in C.claims(n) and F.FAMILIES[n].kind != "ssm"])
def test_unclaimed_quantized_draft_is_refused_not_scored(name):
    with pytest.raises(ValueError):
        C.draft(name, kv_bits=4)


@pytest.mark.parametrize("name", NAMES)
def test_claimed_target(name):
    if "target" not in C.claims(name):
        with pytest.raises(UnsupportedModelError, match=C.TARGET_REFUSED[name]):
            C.target(name)
        return
    assert C.target(name) == "ok"


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma2", "llama4_text", "hunyuan_v1_dense", "hunyuan", "gpt2"])
def test_claimed_store(name):
    assert "store" in C.claims(name) and C.store(name).startswith("ok")
