"""The long-prompt bench's documents (issue 26): with spread=True needle i sits in the i-th part."""
import random

from tools import recall_task


def test_spread_needles_sit_one_in_each_third_and_keep_their_tokens():
    task = recall_task.load()
    for seed in range(5):
        doc = task.make_document(random.Random(seed), 3000, 3, spread=True)
        assert len(doc.tokens) == 3000
        for i, needle in enumerate(doc.needles):
            assert i * 3000 // 3 <= needle.start < (i + 1) * 3000 // 3 + 20, (seed, i, needle.start)
            assert doc.tokens[needle.start + 1:needle.start + 4] == task.answer_ids(needle)
