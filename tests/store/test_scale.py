"""Per-turn work independent of the sessions held (issue 56, STYLE.md habit 9), asserted by counting, not timing.

Each test builds the same store twice, with few and with many sessions over one shared system prompt, wraps the
index's collections (the entries, the policies' orders, the prefix table's sharers, the dirty marks) in ones that
count every item read from them, runs one operation, and asserts that it read as many items either way: a scan of
the index would read more with more sessions.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from hf_attnstore.store.index import BLOCK, PrefixTable

FP = "f" * 64
SYSTEM = torch.arange(1000, 1000 + 16 * BLOCK)  # a shared system prompt of 1,024 tokens
FEW, MANY = 40, 400


class Reads:
    """A count of the items read from the collections `counting` wrapped."""

    def __init__(self):
        self.n = 0

    def counting(self, collection):
        """A copy of `collection` (a dict, an OrderedDict or a set) whose iterations and lookups add to the count."""
        reads = self

        def walk(items):
            for item in items:
                reads.n += 1
                yield item

        if isinstance(collection, set):
            class CountedSet(set):
                def __iter__(self):
                    return walk(super().__iter__())
            return CountedSet(collection)
        base = OrderedDict if isinstance(collection, OrderedDict) else dict

        class CountedDict(base):
            def __iter__(self):
                return walk(super().__iter__())

            def __reversed__(self):
                return walk(super().__reversed__())

            def values(self):
                return walk(super().values())

            def items(self):
                return walk(super().items())

            def get(self, key, default=None):
                reads.n += 1
                return super().get(key, default)

            def __getitem__(self, key):
                reads.n += 1
                return super().__getitem__(key)
        return CountedDict(collection)


def _prompt(i: int) -> torch.Tensor:
    """Session `i`'s ids: the system prompt, then 128 of its own."""
    return torch.cat([SYSTEM, torch.arange(128) + 100_000 * (i + 1)])


def _table_reads(sessions: int, every_depth: bool) -> tuple[int, list]:
    table = PrefixTable()
    for i in range(sessions):
        table.add((FP, f"s{i}"), _prompt(i))
    reads = Reads()
    for block, users in list(table._sessions.items()):
        table._sessions[block] = reads.counting(users)
    new_chat = torch.cat([SYSTEM, torch.tensor([7, 8, 9])])
    found = table.candidates(FP, new_chat, exclude=(FP, "s3"), every_depth=every_depth)
    return reads.n, found


def test_a_prefix_lookup_reads_the_newest_sharers_of_each_block_not_all_of_them():
    for every_depth in (False, True):
        few, found_few = _table_reads(FEW, every_depth)
        many, found_many = _table_reads(MANY, every_depth)
        assert few == many, (every_depth, few, many)
        # The same answer as a scan: the newest 4 sessions sharing the 16 blocks of the system prompt.
        assert found_many == [((FP, f"s{i}"), 16 * BLOCK) for i in range(MANY - 1, MANY - 5, -1)]
