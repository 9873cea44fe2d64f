"""`SamplingParams.updated`: a copy with the changes applied, the same copy for the same changes."""

from __future__ import annotations

import pickle

import pytest

from rllm_async.protocols import SamplingParams


def test_updated_applies_the_changes_and_keeps_the_rest() -> None:
    base = SamplingParams(temperature=0.7, max_tokens=16, stop=("\n",))
    assert base.updated() is base
    assert base.updated(max_tokens=4, seed=3) == SamplingParams(
        temperature=0.7, max_tokens=4, stop=("\n",), seed=3
    )
    assert base.updated(stop=["a", "b"]).stop == ("a", "b")  # a list is stored as a tuple
    with pytest.raises(TypeError, match=r"unknown sampling parameters: \['max_token'\]"):
        base.updated(max_token=4)


def test_the_same_changes_give_the_same_copy_and_other_types_another() -> None:
    base = SamplingParams()
    four = base.updated(max_tokens=4)
    assert base.updated(max_tokens=4) is four
    assert base.updated(max_tokens=5) is not four
    as_float = base.updated(max_tokens=4.0)
    assert as_float is not four and type(as_float.max_tokens) is float
    assert base.updated(stop=["x"]) is not base.updated(stop=["x"])  # unhashable: not kept


def test_the_kept_copies_leave_equality_hashing_and_pickling_alone() -> None:
    base = SamplingParams()
    for n in range(3000):  # more distinct changes than are kept
        assert base.updated(max_tokens=n).max_tokens == n
    assert len(base._copies) <= 1024  # bounded, whatever a run asks for
    copy = base.updated(max_tokens=7)
    assert copy == SamplingParams(max_tokens=7) and hash(copy) == hash(SamplingParams(max_tokens=7))
    assert repr(copy) == repr(SamplingParams(max_tokens=7))
    assert pickle.loads(pickle.dumps(copy)) == copy
