"""A random-weight llama model *folder* (config, weights, a word-level tokenizer with a chat
template) that ``mlx_lm.load`` reads like a real checkpoint, and documents in its words."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from worker.models import hub_identity, local_identity

WORDS = [f"w{i}" for i in range(200)]


def save_random_model(folder: Path, words: list[str] = WORDS) -> Path:
    """A random-weight llama folder with a word-level tokenizer over ``words`` and a chat
    template (vocabulary 512, so up to 506 words)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
    vocab = {w: i for i, w in enumerate(specials + list(words))}
    assert len(vocab) <= 512
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                      eos_token="<|end|>")
    wrapped.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> "
                             "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return save_llama_folder(folder, wrapped, seed=3, vocab_size=512)


def save_llama_folder(folder: Path, tokenizer: Any, *, seed: int, vocab_size: int, **config: Any) -> Path:
    """A random-weight tiny llama (``seed``) that ``mlx_lm.load`` reads like a real checkpoint:
    weights, its config (with ``config``'s fields) and ``tokenizer`` (a ``PreTrainedTokenizerFast``
    with its chat template) in ``tokenizer_config.json``, as a fast tokenizer."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from specprefill_testkit.tiny_models import make_model

    folder.mkdir(parents=True, exist_ok=True)
    model = make_model("llama", seed=seed, vocab_size=vocab_size)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    config = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=vocab_size,
                  tie_word_embeddings=True, **config)
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer.save_pretrained(str(folder))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = tokenizer.chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return folder


def doc_text(seed: int, n: int) -> str:
    return " ".join(WORDS[(seed * 31 + i * 7 + i * i) % len(WORDS)] for i in range(n))


def model_identity(name: str) -> str:
    """Identity of a model named by a local folder or a hub id (no downloads), as the
    worker's loader computes it."""
    return local_identity(name) if Path(name).expanduser().is_dir() else hub_identity(name)
