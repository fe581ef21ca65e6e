"""The context window a config declares (worker/context_window.py): each RoPE scaling type,
each family config of specprefill_testkit/families.py that declares a length, and the guard's message."""
from __future__ import annotations

import json

import pytest

from jobs.contract.spec import ContextLengthError, JobSpecError
from specprefill_testkit.families import FAMILIES
from worker.context_window import ContextWindow, check_context, context_window, model_config

# Real configs' fields (abridged from their config.json files).
LLAMA_3_1 = dict(max_position_embeddings=131072, rope_scaling=dict(
    rope_type="llama3", factor=8.0, original_max_position_embeddings=8192, low_freq_factor=1.0, high_freq_factor=4.0))
QWEN2_5_YARN = dict(max_position_embeddings=32768, rope_scaling=dict(
    type="yarn", factor=4.0, original_max_position_embeddings=32768))
DEEPSEEK_V3 = dict(max_position_embeddings=163840, rope_scaling=dict(
    type="yarn", factor=40, original_max_position_embeddings=4096, mscale=1.0))
GEMMA3_LINEAR = dict(max_position_embeddings=131072, rope_scaling=dict(rope_type="linear", factor=8.0),
                     sliding_window=1024)
MISTRAL_WINDOWED = dict(max_position_embeddings=32768, sliding_window=4096)
PHI3_LONGROPE = dict(max_position_embeddings=131072, original_max_position_embeddings=4096,
                     rope_scaling=dict(type="longrope", long_factor=[1.0], short_factor=[1.0]))


@pytest.mark.parametrize("config, tokens", [
    (dict(max_position_embeddings=8192), 8192),                     # the shipped models
    (LLAMA_3_1, 131072),                                            # 8192 × 8 < the declared 131072
    (dict(LLAMA_3_1, max_position_embeddings=8192), 65536),         # llama3 extends the original
    (QWEN2_5_YARN, 131072),                                         # yarn: 32768 × 4
    (DEEPSEEK_V3, 163840),                                          # yarn: 4096 × 40
    (dict(max_position_embeddings=4096, rope_scaling=dict(type="yarn", factor=2.0)), 8192),  # no original
    (dict(max_position_embeddings=2048, rope_scaling=dict(type="dynamic", factor=4.0)), 8192),
    (GEMMA3_LINEAR, 131072),                                        # linear without an original: as declared
    (dict(max_position_embeddings=4096, rope_scaling=dict(
        rope_type="linear", factor=4.0, original_max_position_embeddings=4096)), 16384),
    (PHI3_LONGROPE, 131072),                                        # longrope without a factor: as declared
    (MISTRAL_WINDOWED, 32768),                                      # a window does not shorten it
    (dict(n_positions=1024, n_ctx=1024), 1024),                     # gpt2
    (dict(text_config=dict(max_position_embeddings=262144)), 262144),  # a multimodal wrapper
    (dict(max_position_embeddings=4096, rope_scaling=dict(type="default")), 4096),
])
def test_the_window_each_rope_scaling_declares(config, tokens):
    assert context_window(config).tokens == tokens


def test_a_config_that_declares_no_length_has_no_window():
    assert context_window(dict(hidden_size=64, sliding_window=16)) is None


# Every family of specprefill_testkit/families.py whose config declares a length, with the window
# the guard reads from it (the rest declare none: hunyuan's dynamic NTK-alpha scaling has no
# max_position_embeddings to scale, gemma3_text / gpt_oss / cohere2 only windows).
FAMILY_WINDOWS = {
    "qwen3": 4096, "qwen3_moe": 4096, "granite": 4096, "glm4_moe": 4096, "exaone4": 4096,
    "ernie4_5": 4096, "olmo3": 4096, "ministral3": 64, "mistral3_ministral3": 64,
    "gemma4_text": 4096, "exaone4_hybrid": 4096, "deepseek_v3": 4096, "hunyuan_v1_dense": 4096,
    "llama4": 4096, "gpt2": 128, "gpt_bigcode": 128, "iquestloopcoder": 4096, "deepseek_v32": 4096,
    "qwen3_5": 4096, "qwen3_5_moe": 4096, "qwen3_next": 4096, "lfm2": 4096, "nemotron_h": 4096,
    "granitemoehybrid": 4096, "falcon_h1": 4096,
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_family_config(name):
    window = context_window(FAMILIES[name].args)
    assert (window.tokens if window else None) == FAMILY_WINDOWS.get(name)


def test_ministral3_yarn_is_original_times_factor_not_more():
    # 16 × 4 = 64, the declared max_position_embeddings: the larger of the two
    window = context_window(FAMILIES["ministral3"].args)
    assert window == ContextWindow(64, "max_position_embeddings 64")
    bigger = dict(FAMILIES["ministral3"].args, max_position_embeddings=32)
    assert context_window(bigger).tokens == 64 and "yarn" in context_window(bigger).source


def test_config_comes_from_the_folder_then_the_model_args(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_5_YARN))
    assert context_window(model_config(tmp_path, None)).tokens == 131072

    class Model:
        class args:
            max_position_embeddings = 512
    assert context_window(model_config(tmp_path / "missing", Model())).tokens == 512


def test_the_refusal_names_both_numbers_and_the_field():
    window = ContextWindow(8192, "max_position_embeddings 8192")
    with pytest.raises(ContextLengthError, match=r"^input: the prompt's 20874 tokens plus n_lookahead 8 "
                                                 r"\(20882\) are more than the 8192 tokens the draft model"):
        check_context(20874, 8, "n_lookahead", window, "draft", allowed=False)
    with pytest.raises(ContextLengthError, match=r"^max_tokens: .* 8000 tokens plus max_tokens 256 \(8256\)"
                                                 r".* 8192 tokens the target model"):
        check_context(8000, 256, "max_tokens", window, "target", allowed=False)
    assert issubclass(ContextLengthError, JobSpecError)  # bad input: the worker keeps running
    check_context(8192 - 256, 256, "max_tokens", window, "target", allowed=False)  # exactly fits
    check_context(20874, 8, "n_lookahead", window, "draft", allowed=True)  # the opt-in
    check_context(10**6, 0, "max_tokens", None, "target", allowed=False)  # no declared window
