"""Model folders with real chat-template styles for the conversation and tool-call tests.

Each folder is what ``mlx_lm.load`` reads like a real checkpoint: a random-weight tiny llama
and a byte-level BPE tokenizer (every text encodes, as Qwen's and Mistral's do) whose added
tokens and chat template are the style's own (tests/support/chat_templates: Qwen3's template,
with ``<tool_call>`` calls and ``<think>`` reasoning, and Mistral-Nemo's, with ``[TOOL_CALLS]``
and 9-character call ids). mlx-lm infers the tool parser from the template, as for the real
models: ``json_tools`` for Qwen3, ``mistral`` for Mistral.

A ``script.json`` in the folder makes the target a scripted one (tests/support/scripted_target.py).
"""
from __future__ import annotations

import json
from pathlib import Path

from specprefill_testkit.model_folders import save_llama_folder

TEMPLATES = Path(__file__).resolve().parent / "chat_templates"
# style -> (template file, eos, bos, added tokens: (text, special))
STYLES = {
    "qwen3": ("qwen3.jinja", "<|im_end|>", None,
              [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
               ("<tool_call>", False), ("</tool_call>", False), ("<tool_response>", False),
               ("</tool_response>", False), ("<think>", False), ("</think>", False)]),
    "mistral": ("mistral_nemo.jinja", "</s>", "<s>",
                [("<unk>", True), ("<s>", True), ("</s>", True), ("[INST]", True), ("[/INST]", True),
                 ("[TOOL_CALLS]", True), ("[AVAILABLE_TOOLS]", True), ("[/AVAILABLE_TOOLS]", True),
                 ("[TOOL_RESULTS]", True), ("[/TOOL_RESULTS]", True)]),
}
VOCAB_SIZE = 320  # 256 bytes + the added tokens, padded


def _tokenizer(style: str):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    template, eos, bos, added = STYLES[style]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, s in added if s])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, s in added if not s])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=bos,
                                      unk_token="<unk>" if style == "mistral" else None,
                                      pad_token=eos, clean_up_tokenization_spaces=False)
    wrapped.chat_template = (TEMPLATES / template).read_text()
    return wrapped


def save_chat_model(folder: Path, style: str, script: dict | None = None) -> Path:
    """A random-weight llama folder with ``style``'s tokenizer and chat template (and
    ``script.json`` when given: the scripted target's rules)."""
    tokenizer = _tokenizer(style)
    assert len(tokenizer) <= VOCAB_SIZE
    save_llama_folder(folder, tokenizer, seed=5, vocab_size=VOCAB_SIZE, eos_token_id=tokenizer.eos_token_id)
    if script is not None:
        (folder / "script.json").write_text(json.dumps(script))
    return folder


def load_tokenizer(folder: Path):
    """The folder's tokenizer as mlx-lm wraps it (TokenizerWrapper: tool parser, think markers)."""
    from mlx_lm.tokenizer_utils import load

    return load(Path(folder))
