import pytest

from jobs.settings import Settings


def test_env_prefix_overrides_and_types():
    s = Settings.from_env({"SPECPREFILL_KEEP": "0.3", "SPECPREFILL_BLOCK_SIZE": "128",
                           "SPECPREFILL_QUEUE_NAMES": "a, b", "SPECPREFILL_OPENBLAS": "off",
                           "REDIS_URL": "redis://h:1/0"})
    assert s.keep == 0.3 and s.block_size == 128
    assert s.queue_names == ("a", "b") and s.openblas is False
    assert s.redis_url == "redis://h:1/0"
    assert s.block_store_url == "redis://h:1/0"


def test_bad_env_value_names_the_variable():
    with pytest.raises(ValueError, match="SPECPREFILL_BLOCK_SIZE"):
        Settings.from_env({"SPECPREFILL_BLOCK_SIZE": "big"})
