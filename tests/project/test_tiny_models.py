"""The shipped tiny models, their tokenizer, training script and the demo data."""
from __future__ import annotations

import json
import lzma
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import generate, load

from tools import make_demo, recall_task, train_tiny

REPO = Path(__file__).resolve().parents[2]
DRAFT = REPO / "models" / "draft-tiny"
TARGET = REPO / "models" / "target-tiny"
DOC_SEEDS = (11, 12, 13, 14, 15, 16)
PARAGRAPH = ("It is a truth universally acknowledged, that a single man in possession of a good fortune "
             "must be in want of a wife. Naïve café owners in Zürich paid 12.50 € for 🍰 and said “déjà vu”;\n"
             "\tthe Python docs say: def f(x): return x ** 2  # ok")
task = recall_task.load()


@pytest.fixture(scope="module")
def draft():
    return load(str(DRAFT))


def documents_512():
    """Six fixed 512-token recall prompts (plain form) with 4 needles each."""
    return [task.make_example(random.Random(seed), 512, 4) for seed in DOC_SEEDS]


@pytest.mark.parametrize("folder", [DRAFT, TARGET], ids=["draft", "target"])
def test_shipped_model_loads_offline(folder, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tokenizer = load(str(folder))
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == task.tok.get_vocab_size()
    assert tokenizer.eos_token_ids == {task.end}
    text = "On the card she found the words Orion cobalt falcon quartz.\n\nWhich words came after Orion"
    assert tokenizer.encode(text, add_special_tokens=False) == task.encode(text)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    assert chat == [task.id["<|user|>"], *task.encode(text), task.end, task.id["<|assistant|>"]]
    assert (folder / "README.md").exists()
    assert (folder / "model.safetensors").stat().st_size < 16e6  # shipped in git: keep it small


@pytest.mark.parametrize("folder", [DRAFT, TARGET], ids=["draft", "target"])
def test_english_text_has_no_unknown_tokens(folder):
    """Byte-level BPE: every UTF-8 string encodes (no unknown token exists) and decodes back."""
    _, tokenizer = load(str(folder))
    tok_json = json.loads((folder / "tokenizer.json").read_text())
    assert tok_json["model"]["type"] == "BPE" and tok_json["model"].get("unk_token") is None
    assert tokenizer.unk_token_id is None
    ids = tokenizer.encode(PARAGRAPH, add_special_tokens=False)
    assert ids and all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == PARAGRAPH
    # Real English is mostly whole-word tokens, not a byte soup.
    english = PARAGRAPH.split(" Naïve")[0]
    assert len(tokenizer.encode(english, add_special_tokens=False)) < len(english) / 3


def test_task_words_are_single_tokens_absent_from_the_corpus():
    text = lzma.open(recall_task.CORPUS, "rt", encoding="utf-8").read().lower()
    words = set(re.findall(r"[a-z]+", text))
    planted = recall_task.KEYS + recall_task.VALUES
    assert not [w for w in planted if w.lower() in words]
    assert len(set(planted)) == len(planted)
    assert len({task.key_id[k] for k in recall_task.KEYS} | {task.value_id[v] for v in recall_task.VALUES}) \
        == len(planted)


def test_target_has_at_least_four_times_the_draft_compute():
    d = json.loads((DRAFT / "config.json").read_text())
    t = json.loads((TARGET / "config.json").read_text())

    def flops_per_token(c):  # matmul weights per layer; the tied embedding is shared by both
        h, i, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
        kv = h * c["num_key_value_heads"] // c["num_attention_heads"]
        return layers * (2 * h * h + 2 * h * kv + 3 * h * i)

    assert flops_per_token(t) >= 4 * flops_per_token(d)


@pytest.mark.parametrize("folder", [DRAFT, TARGET], ids=["draft", "target"])
def test_shipped_model_answers_recall_on_512_token_documents(folder, draft):
    model, tokenizer = draft if folder == DRAFT else load(str(folder))
    correct = 0
    for ex in documents_512():
        prompt = tokenizer.decode(ex.tokens[:ex.prompt_len])
        text = generate(model, tokenizer, prompt=prompt, max_tokens=6)
        correct += text.split()[:3] == ex.document.needle(ex.key).value
    assert correct >= len(DOC_SEEDS) - 1


def test_draft_keeps_the_needle_chunk_at_keep_0_2(draft):
    from specprefill.options import ScoringOptions, SelectionOptions
    from specprefill.profile import profile_model
    from specprefill.scoring import score_tokens
    from specprefill.selection import select_chunks

    profile = profile_model(draft[0])
    kept = 0
    for i, ex in enumerate(documents_512()):
        result = score_tokens(profile, ex.tokens[:ex.prompt_len], ScoringOptions(seed=i))
        indices = select_chunks(result.importance, SelectionOptions(keep=0.2, chunk_size=32, tail_tokens=32))
        s, e = ex.needle_span
        kept += bool(np.isin(np.arange(s, e), indices).all())
    # Random selection keeps a needle (1-2 chunks) with probability at most 3/15 here.
    assert kept >= len(DOC_SEEDS) - 1


# The three tests that build the seed-0 induction circuit run on one test worker: its codes are
# computed once per process (tools.induction_init.spread_codes), a minute each time.
INDUCTION = pytest.mark.xdist_group("induction-codes")


@INDUCTION
def test_training_script_runs_end_to_end(tmp_path):
    # Seed 0, as the induction and re-base tests: the circuit's codes (a minute to repel) are
    # then built once per process (tools.induction_init.spread_codes).
    args = ["--hidden-size", "96", "--layers", "2", "--heads", "3", "--kv-heads", "3",
            "--intermediate-size", "64", "--phases", "128:3,128-192:2", "--tokens-per-step", "256",
            "--eval-samples", "2", "--eval-lengths", "128", "--log-every", "1", "--seed", "0",
            "--tokenizer", str(DRAFT / "tokenizer.json")]
    train_tiny.main(args + ["--out", str(tmp_path / "a")])
    model, tokenizer = load(str(tmp_path / "a"))
    ids = task.encode("Which words came after Orion")
    assert model(mx.array([ids])).shape == (1, len(ids), task.tok.get_vocab_size())
    assert tokenizer.encode(PARAGRAPH, add_special_tokens=False) == task.encode(PARAGRAPH)
    training = json.loads((tmp_path / "a" / "training.json").read_text())
    assert set(training["eval"]["128"]) == {"plain", "chat"}
    # Seeded: a second run gives the same weights.
    train_tiny.main(args + ["--out", str(tmp_path / "b"), "--eval-samples", "0"])
    a = mx.load(str(tmp_path / "a" / "model.safetensors"))
    b = mx.load(str(tmp_path / "b" / "model.safetensors"))
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)


def test_tokenizer_training_is_deterministic_and_matches_the_shipped_one():
    from tools import english_tokenizer

    tok = english_tokenizer.train_tokenizer(recall_task.paragraphs(), recall_task.KEYS + recall_task.VALUES)
    assert tok.get_vocab() == task.tok.get_vocab()
    assert tok.encode(PARAGRAPH).ids == task.encode(PARAGRAPH)


@INDUCTION
def test_induction_init_answers_recall_before_any_training():
    from mlx_lm.models import llama

    from tools.induction_init import init_induction_circuit

    config = train_tiny.model_config(task, rope_theta=1e6, **train_tiny.PRESETS["draft"])
    model = llama.Model(llama.ModelArgs.from_dict(config))
    init_induction_circuit(model, seed=0, relay_token=task.id["<|assistant|>"], closer_tokens=(task.end,))
    rng = random.Random(0)
    for length, chat in ((256, False), (2048, False), (512, True)):
        rows = np.array([task.make_example(rng, length, 4, chat=chat).tokens for _ in range(8)])
        logits = model(mx.array(rows[:, :-1]))
        # The three value tokens are induction steps (the first after the chat closers for
        # chat): the untrained circuit gets them right; <|end|> is left to training.
        predicted = np.array(logits[:, -4:-1].argmax(-1))
        assert (predicted == rows[:, -4:-1]).all(axis=1).mean() >= 0.85, (length, chat)
    small = llama.Model(llama.ModelArgs.from_dict(dict(config, hidden_size=32, num_attention_heads=2,
                                                       num_key_value_heads=1)))
    with pytest.raises(ValueError, match="too small"):
        init_induction_circuit(small, seed=0)


def test_phase_spec_is_validated():
    assert train_tiny.parse_phases("64:10,128-512:5") == [([64], 10), ([128, 192, 256, 384, 512], 5)]
    with pytest.raises(ValueError, match="--phases"):
        train_tiny.parse_phases("64")
    with pytest.raises(ValueError, match="--phases"):
        train_tiny.parse_phases("16:10")


def test_documents_hold_their_needles_at_the_recorded_positions():
    rng = random.Random(5)
    for n_tokens, n_needles in ((128, 2), (512, 8), (2000, 6)):
        doc = task.make_document(rng, n_tokens, n_needles)
        assert len(doc.tokens) == n_tokens and len(doc.needles) == n_needles
        assert len({n.key for n in doc.needles}) == n_needles
        for n in doc.needles:
            s, e = n.span
            assert doc.tokens[s:e] == [task.key_id[n.key], *(task.value_id[v] for v in n.value)]
            assert doc.tokens.count(task.key_id[n.key]) == 1  # the name marks one place
    loose = task.make_document(rng, 1500, 6, exact=False)  # demo documents: whole sentences
    assert len(loose.tokens) <= 1500 and task.encode(loose.text) == loose.tokens
    with pytest.raises(ValueError, match="n_needles"):
        task.make_document(rng, 100, 0)


@pytest.mark.parametrize("chat", [False, True])
def test_examples_end_in_the_question_and_answer(chat):
    ex = task.make_example(random.Random(3), 768, 5, chat=chat, system_tokens=6 if chat else 0)
    assert len(ex.tokens) == 768
    prompt = task.decode(ex.tokens[:ex.prompt_len])
    closer = "<|end|><|assistant|>" if chat else ""
    assert prompt.endswith(f"\n\nWhich words came after {ex.key}{closer}")
    assert ex.tokens[ex.prompt_len:] == ex.answer + [task.end]
    assert ex.tokens[ex.needle_span[0]] == task.key_id[ex.key]
    if chat:
        assert prompt.startswith("<|system|>") and "<|end|><|user|>" in prompt


def test_shipped_demo_files_are_reproducible(tmp_path):
    make_demo.main(["--out", str(tmp_path)])
    for name in ("documents.jsonl", "questions.jsonl"):
        assert (tmp_path / name).read_text() == (REPO / "models" / "demo" / name).read_text()
    docs = {d["id"]: d for d in map(json.loads, (tmp_path / "documents.jsonl").read_text().splitlines())}
    for q in map(json.loads, (tmp_path / "questions.jsonl").read_text().splitlines()):
        doc = docs[q["doc_id"]]
        key = q["question"].split()[-1]
        needle = next(n for n in doc["needles"] if n["key"] == key)
        s, e = needle["char_span"]
        assert doc["text"][s:e].strip() == f"{key} {q['answer']}"
        ts, te = needle["token_span"]
        assert task.decode(task.encode(doc["text"])[ts:te]).strip() == f"{key} {q['answer']}"
        assert doc["text"].count(key) == 1


def test_hub_id_loads_from_the_local_hub_cache(tmp_path):
    """The hub path of ``mlx_lm.load``: a model already in the Hugging Face cache loads by its
    repo id with the network off, and the worker names it by repo and revision."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--local--draft-tiny"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for f in DRAFT.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    code = (
        "from mlx_lm import load\n"
        "from specprefill_testkit.model_folders import model_identity\n"
        "model, tok = load('local/draft-tiny')\n"
        "print(type(model).__module__, model_identity('local/draft-tiny'))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["mlx_lm.models.llama", f"hub:local/draft-tiny@{revision}"]
    missing = subprocess.run([sys.executable, "-c", "from specprefill_testkit.model_folders import model_identity\n"
                              "model_identity('local/absent')"],
                             capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert "is a hub model not downloaded on this worker: pre-download it there with " \
        "`hf download local/absent`" in missing.stderr
