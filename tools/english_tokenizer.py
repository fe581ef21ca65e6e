"""The shipped models' tokenizer: byte-level BPE trained on the Austen corpus, with a chat template.

Byte-level: every UTF-8 byte is a base token, so any text encodes and no unknown token exists.
The BPE merges are learnt (``tokenizers``, seeded by its deterministic trainer) from the corpus
plus the recall task's names and value words, each repeated so it becomes one token: the
induction circuit of the shipped models matches and copies whole tokens.

Saved with ``PreTrainedTokenizerFast.save_pretrained`` and ``tokenizer_class`` set to
``PreTrainedTokenizerFast`` (loads in transformers 4 and 5), so ``mlx_lm.load`` reads it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

VOCAB_SIZE = 2048
END = "<|end|>"
SPECIAL_TOKENS = ["<pad>", END, "<|system|>", "<|user|>", "<|assistant|>"]
# Markers are single special tokens and no spaces are added: "<|user|>TEXT<|end|><|assistant|>".
# With ``tools`` the first turn is a system turn listing them (the caller's system message first),
# and a call is Qwen-style JSON in <tool_call> tags, so mlx-lm picks its json_tools parser
# ("<tool_call>" and "tool_call.name" in the template). A tool result is a "<|tool|>" turn
# (plain text: the role marker is not a special token). After a tool result the question the
# tools answer (the last user message) is repeated before the generation prompt: the shipped
# models answer a question about a name from the name read last (tools/induction_init.py).
CHAT_TEMPLATE = (
    "{%- set ns = namespace(question='') -%}"
    "{%- if tools -%}<|system|>"
    "{%- if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif -%}"
    "# Tools\nYou may call these functions:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor -%}"
    "</tools>\nTo call one, reply with <tool_call>\n{\"name\": <function name>, "
    "\"arguments\": <arguments as a JSON object>}\n</tool_call><|end|>"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' %}{% set ns.question = message['content'] %}{% endif -%}"
    "{%- if tools and loop.first and message['role'] == 'system' -%}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') -%}"
    "<|assistant|>{{ message['content'] or '' }}"
    "{%- for tool_call in message['tool_calls'] -%}"
    "{%- if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif -%}"
    "<tool_call>\n{\"name\": \"{{ tool_call.name }}\", \"arguments\": "
    "{%- if tool_call.arguments is string %} {{ tool_call.arguments }}{% else %} {{ tool_call.arguments | tojson }}"
    "{%- endif %}}\n</tool_call>"
    "{%- endfor %}<|end|>"
    "{%- else %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{%- if messages and messages[-1]['role'] == 'tool' and ns.question %}<|user|>{{ ns.question }}<|end|>{% endif -%}"
    "<|assistant|>{%- endif -%}"
)
WORD_REPEATS = 4000  # far above the last merge's pair count on this corpus


def train_tokenizer(texts: Iterable[str], words: Iterable[str], vocab_size: int = VOCAB_SIZE):
    """A ``tokenizers.Tokenizer`` (byte-level BPE) trained on ``texts``; each of ``words``
    (with its leading space) ends up a single token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    words = list(words)
    extra = [" ".join([w] * WORD_REPEATS) for w in words]
    tok.train_from_iterator([*texts, *extra], trainer=trainer)
    split = [w for w in words if len(tok.encode(" " + w).ids) != 1]
    if split:
        raise ValueError(f"vocab_size {vocab_size} too small: {split[:5]} are not single tokens")
    return tok


def wrap(tok):
    """The ``transformers`` wrapper mlx-lm loads, with the special tokens and the chat template."""
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token=END,
                                      additional_special_tokens=SPECIAL_TOKENS[2:])
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def save(tok, folder: Path) -> None:
    """Write ``tokenizer.json`` and a portable ``tokenizer_config.json`` into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    wrap(tok).save_pretrained(str(folder))
    # transformers 5 writes "TokenizersBackend" (unknown to transformers 4) and may put the
    # template in a separate file; keep one portable tokenizer_config.json.
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg.pop("unk_token", None)
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    for extra in ("chat_template.jinja", "special_tokens_map.json"):
        (folder / extra).unlink(missing_ok=True)
