"""ShareGPT reading: a file cut off mid-record, turn pairing, and rejoining the split file's parts."""

from __future__ import annotations

import json
import re

import pytest

from hf_attnstore.lab.data import iter_sharegpt, load_sharegpt


def record(rid, *turns):
    return {"id": rid, "conversations": [{"from": f, "value": v} for f, v in turns]}


RECORDS = [
    record("a_0", ("human", "q1"), ("gpt", "r1")),
    record("a_2", ("gpt", "r1 continued"), ("human", "q2"), ("gpt", "r2")),  # a part opening with a reply
    record("b_0", ("gpt", "hello"), ("human", "q"), ("human", "q again")),
    record("c", ("human", "only"), ("gpt", "answer")),
]


@pytest.fixture
def cut_file(tmp_path):
    text = json.dumps(RECORDS + [record("d_0", ("human", "lost"))])
    path = tmp_path / "sharegpt.json"
    path.write_text(text[: text.rindex("lost")])  # cut inside the last record, as the packaged file is
    return path


def test_reads_up_to_the_last_complete_record(cut_file):
    convs = list(iter_sharegpt(cut_file))
    assert [c.id for c in convs] == ["a_0", "a_2", "b_0", "c"]
    assert convs[1].messages[0]["role"] == "user"  # leading replies of a record are dropped
    assert convs[2].turns == [("q", ""), ("q again", "")]  # two user messages in a row
    assert convs[3].turns == [("only", "answer")]
    assert len(list(iter_sharegpt(cut_file, raw=True))) == 4


def test_rejoin_joins_consecutive_parts(cut_file):
    convs = list(iter_sharegpt(cut_file, rejoin=True))
    assert [c.id for c in convs] == ["a", "b", "c"]
    # Inside a joined conversation the continued reply stays: it follows the first reply.
    assert [m["content"] for m in convs[0].messages] == ["q1", "r1", "r1 continued", "q2", "r2"]
    assert convs[0].turns == [("q1", "r1"), ("q2", "r2")]
    assert [c.id for c in iter_sharegpt(cut_file, rejoin=True, limit=2)] == ["a", "b"]


@pytest.mark.integration
def test_the_packaged_file():
    convs = list(iter_sharegpt())
    assert len(list(iter_sharegpt(raw=True))) == 17_671  # complete records before the cut
    multi = sum(len(c.user_turns) >= 2 for c in convs) / len(convs)
    assert 0.70 < multi < 0.80  # ~73% multi-turn, as in the paper
    joined = list(iter_sharegpt(rejoin=True))
    assert 9_000 < len(joined) < 10_000  # the paper's "9K sessions"
    assert sum(len(c.turns) for c in joined) / len(joined) > sum(len(c.turns) for c in convs) / len(convs)
    first = load_sharegpt(limit=3, min_user_turns=2, rejoin=True)
    assert len(first) == 3 and not any(re.search(r"_\d+$", c.id) for c in first)  # ids lose the part suffix
