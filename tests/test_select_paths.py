"""A load's ``keys`` cut the saved tree down (tree.select_paths) in time linear in the tree,
however many keys are asked for, and say which keys name nothing, including keys that lie
under another key asked for."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from aiockpt._core.tree import DICT, LIST, STATEFUL, TENSOR, TUPLE, KeyPaths, select_paths


def model_tree() -> dict:
    return {
        DICT: [
            ["model", {DICT: [["a", {TENSOR: "model/a"}], ["b", {TENSOR: "model/b"}]]}],
            ["opt", {TENSOR: "opt"}],
        ]
    }


def test_a_key_under_another_key_asked_for_is_found():
    for keys in (("model", "model/a"), ("model/a", "model")):
        pruned, unmatched = select_paths(model_tree(), keys)
        assert unmatched == set()
        assert pruned == {DICT: [model_tree()[DICT][0]]}


def test_a_missing_key_under_another_key_asked_for_is_named():
    _, unmatched = select_paths(model_tree(), ("model", "model/zzz", "model/a/deeper"))
    assert unmatched == {"model/zzz", "model/a/deeper"}


def test_key_paths_answer_what_a_path_selects_and_what_lies_below_it():
    paths = KeyPaths(("model/layers.3", "opt", "a/b/c"))
    assert paths.selects("opt")
    assert paths.selects("opt/state/0")
    assert paths.selects("a/b/c/d")
    assert not paths.selects("model")
    assert not paths.selects("optim")
    assert not paths.selects("")
    assert sorted(paths.below("")) == ["a/b/c", "model/layers.3", "opt"]
    assert paths.below("a") == ["a/b/c"]
    assert paths.below("a/b") == ["a/b/c"]
    assert paths.below("opt") == []
    assert paths.below("model/layers") == []


def test_thousands_of_keys_are_cut_asking_once_per_node(monkeypatch):
    """A strict=False load into half of a 40k-tensor state asks for 20k key paths: the cut
    compared each saved path with every key (16 s at 10k keys). Now each node it visits
    asks KeyPaths once, whose answer costs the path's depth in set lookups."""
    n = 20_000
    tree = {
        DICT: [
            [part, {DICT: [[f"t{i}", {TENSOR: f"{part}/t{i}"}] for i in range(n)]}]
            for part in ("model", "optim")
        ]
    }
    keys = tuple(f"model/t{i}" for i in range(n))
    asked: list[str] = []
    above = KeyPaths.above
    monkeypatch.setattr(
        KeyPaths, "above", lambda self, path: asked.append(path) or above(self, path)
    )
    dropped: list[str] = []
    pruned, unmatched = select_paths(tree, keys, dropped)
    assert unmatched == set()
    assert dropped == ["optim"]
    assert len(pruned[DICT][0][1][DICT]) == n
    assert len(asked) == len(set(asked)) == n + 3  # the root, model, optim, model's tensors


# ---------------------------------------------------------------------------- the oracle

names = st.sampled_from(["a", "b", "c", "0", "1"])


def leaf(draw_name: str) -> dict:
    return {TENSOR: draw_name}


trees = st.recursive(
    names.map(leaf),
    lambda inner: st.one_of(
        st.dictionaries(names, inner, max_size=3).map(
            lambda d: {DICT: [[k, v] for k, v in d.items()]}
        ),
        st.lists(inner, max_size=2).map(lambda xs: {LIST: xs}),
        st.lists(inner, max_size=2).map(lambda xs: {TUPLE: xs}),
        inner.map(lambda x: {STATEFUL: x}),
    ),
    max_leaves=12,
)
key_paths = st.lists(names, min_size=1, max_size=4).map("/".join)


def oracle(tree: Any, keys: tuple[str, ...]) -> tuple[Any, set[str], list[str]]:
    """What select_paths must give, compared key by key: a node lying at or under a key is
    kept whole; a dict, or a stateful object, on the way to a key is cut down; a list on the
    way is kept whole. A key names something when a node lies at it, or when a list kept
    whole lies on its way."""
    dropped: list[str] = []

    def cut(node: Any, path: str) -> Any:
        if any(path == k or path.startswith(k + "/") for k in keys):
            return node
        if not any(not path or k.startswith(path + "/") for k in keys):
            return None
        ((tag, body),) = node.items()
        if tag in (LIST, TUPLE):
            return node
        if tag == STATEFUL:
            return (inner := cut(body, path)) and {STATEFUL: inner}
        if tag != DICT:
            return None
        joined = [(key, f"{path}/{key}" if path else str(key), child) for key, child in body]
        cuts = [(key, at, cut(child, at)) for key, at, child in joined]
        dropped.extend(at for _, at, kept in cuts if kept is None)
        return {DICT: kept} if (kept := [[key, c] for key, _, c in cuts if c is not None]) else None

    def names_something(node: Any, parts: list[str]) -> bool:
        ((tag, body),) = node.items()
        if not parts:
            return True
        if tag == STATEFUL:
            return names_something(body, parts)
        if tag == DICT:
            return any(str(k) == parts[0] and names_something(v, parts[1:]) for k, v in body)
        return tag in (LIST, TUPLE)

    pruned = cut(tree, "")
    if pruned is None:
        ((tag, _),) = tree.items()
        pruned = {STATEFUL: {DICT: []}} if tag == STATEFUL else {DICT: []}
    unmatched = {k for k in keys if not names_something(tree, k.split("/"))}
    return pruned, unmatched, dropped


def paths_in(node: Any, path: str = "") -> list[str]:
    """The key paths of the tree's dict items, at every depth."""
    ((tag, body),) = node.items()
    if tag == STATEFUL:
        return paths_in(body, path)
    if tag != DICT:
        return []
    found = []
    for key, child in body:
        at = f"{path}/{key}" if path else str(key)
        found += [at, *paths_in(child, at)]
    return found


@settings(max_examples=300, deadline=None)
@given(tree=trees, data=st.data())
def test_selecting_keys_agrees_with_the_oracle(tree, data):
    # Keys the tree holds (so that one often lies under another) and keys drawn at random.
    held = paths_in(tree)
    some = st.one_of(key_paths, st.sampled_from(held)) if held else key_paths
    keys = tuple(data.draw(st.lists(some, max_size=5)))
    dropped: list[str] = []
    pruned, unmatched = select_paths(tree, keys, dropped)
    expect_pruned, expect_unmatched, expect_dropped = oracle(tree, keys)
    assert (pruned, unmatched) == (expect_pruned, expect_unmatched)
    assert sorted(dropped) == sorted(expect_dropped)  # the order is not part of the answer
