"""The pipe's messages survive the pipe: a LoadReply, whose tree and places cross it as one
marshal blob (see LoadReply.__reduce__), comes out equal to what went in."""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
from multiprocessing.reduction import ForkingPickler

from hypothesis import given, settings
from hypothesis import strategies as st

from aiockpt._core.protocol import LoadReply

#: What a state tree holds (see _core.tree): JSON values, in tagged one-member dicts and lists.
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
trees = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.text(max_size=4), inner, max_size=4),
        st.lists(st.tuples(st.one_of(st.text(max_size=4), st.integers()), inner), max_size=4),
    ),
    max_leaves=30,
)
places = st.dictionaries(
    st.text(max_size=12),
    st.tuples(
        st.sampled_from(["F32", "BF16", "U8"]),
        st.lists(st.integers(0, 1 << 40), max_size=4).map(tuple),
        st.integers(0, 1 << 50),
    ),
    max_size=6,
)


def reply(tensors: dict, tree: object, **fields: object) -> LoadReply:
    base = {
        "step": 7,
        "segment": "seg",
        "size": 4096,
        "tensors": tensors,
        "tree": tree,
        "metrics": {"loss": 0.5, "bad": math.inf},
        "metadata": {"run": "a"},
        "created_at": 1.5,
        "nbytes": 123,
        "url": "file:///x",
        "read_nbytes": 9,
        "left_out": ("model/b",),
        "windows": ((0, 10), (10, 20)),
        "pending": True,
        "image": True,
    }
    base.update(fields)
    return LoadReply(**base)  # type: ignore[arg-type]


@settings(max_examples=80, deadline=None)
@given(tensors=places, tree=trees)
def test_a_load_reply_crosses_the_pipe_unchanged(tensors, tree):
    sent = reply(tensors, tree)
    got = ForkingPickler.loads(bytes(ForkingPickler.dumps(sent)))
    assert got == sent
    assert type(got.tree) is type(sent.tree)


def test_every_field_of_a_load_reply_crosses_a_real_pipe():
    """Through a multiprocessing pipe, as the daemon sends it, field by field."""
    tree = {"D": [["w", {"T": "w"}], [0, {"V": None}], ["lr", {"F": "nan"}]]}
    sent = reply({"w": ("F32", (2, 3), 0)}, tree, segment=None, pending=False)
    a, b = multiprocessing.Pipe()
    try:
        a.send(sent)
        got = b.recv()
    finally:
        a.close()
        b.close()
    for f in dataclasses.fields(LoadReply):
        assert getattr(got, f.name) == getattr(sent, f.name), f.name
