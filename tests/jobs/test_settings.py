import pytest

from jobs.settings import Settings


def test_env_prefix_overrides_and_types():
    s = Settings.from_env({"SPECPREFILL_KEEP": "0.3", "SPECPREFILL_BLOCK_SIZE": "128",
                           "SPECPREFILL_QUEUE_NAMES": "a, b", "SPECPREFILL_OPENBLAS": "off",
                           "REDIS_URL": "redis://h:1/0"})
    assert s.selection.keep == 0.3 and s.block_size == 128
    assert s.queue_names == ("a", "b") and s.openblas is False
    assert s.redis_url == "redis://h:1/0"
    assert s.block_store_url == "redis://h:1/0"


def test_bad_env_value_names_the_variable():
    with pytest.raises(ValueError, match="SPECPREFILL_BLOCK_SIZE"):
        Settings.from_env({"SPECPREFILL_BLOCK_SIZE": "big"})


def test_option_settings_are_the_option_objects_fields():
    from specprefill.options import ScoringOptions, SelectionOptions

    s = Settings.from_env({"SPECPREFILL_TEMPERATURE": "0.1", "SPECPREFILL_N_LOOKAHEAD": "3",
                           "SPECPREFILL_INCLUDE_LAST_QUERY": "no", "SPECPREFILL_THRESHOLD": "9",
                           "SPECPREFILL_PREFILL_STEP": "64"}, keep=0.5)
    assert s.scoring == ScoringOptions(temperature=0.1, n_lookahead=3, include_last_query=False)
    assert s.selection == SelectionOptions(threshold=9, keep=0.5) and s.prefill_step == 64
    # replace takes option settings by name, on top of the groups it has
    assert s.replace(tail_tokens=4).selection == SelectionOptions(threshold=9, keep=0.5, tail_tokens=4)
    assert s.replace(selection=SelectionOptions(keep=0.1)).selection.threshold == 8192
    with pytest.raises(ValueError, match=r"setting pool_kernel \(SPECPREFILL_POOL_KERNEL\): 1024 is outside"):
        Settings.from_env({"SPECPREFILL_POOL_KERNEL": "1024"})
    with pytest.raises(ValueError, match="setting selection: expected SelectionOptions"):
        Settings(selection={"keep": 0.2})


def test_engine_settings_are_checked():
    s = Settings.from_env({"SPECPREFILL_MAX_DECODE_GAP_S": "0.25", "SPECPREFILL_PREFILL_ORDER": "fifo",
                           "SPECPREFILL_PREFILL_CHUNK_TOKENS": "512"})
    assert (s.max_decode_gap_s, s.prefill_order, s.prefill_chunk_tokens) == (0.25, "fifo", 512)
    with pytest.raises(ValueError, match=r"max_decode_gap_s \(SPECPREFILL_MAX_DECODE_GAP_S\): must be in \[0.001, 60\]"):
        Settings.from_env({"SPECPREFILL_MAX_DECODE_GAP_S": "0"})
    with pytest.raises(ValueError, match=r"prefill_order \(SPECPREFILL_PREFILL_ORDER\): must be one of shortest, fifo"):
        Settings(prefill_order="lifo")
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        Settings(prefill_chunk_tokens=-1)
