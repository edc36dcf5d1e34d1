"""The state-tree format: its one walker, the validation of untrusted trees, the listing of
plain values, and the encoding of non-finite floats."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

from aiockpt._core import format as fmt
from aiockpt._core import tree, values
from aiockpt._trainer.load.restore import unflatten
from aiockpt._trainer.state import flatten
from aiockpt.errors import CorruptCheckpointError, UnsupportedValueError


class Stateful:
    def __init__(self) -> None:
        self.sd = {"count": 3, "buf": torch.zeros(2)}

    def state_dict(self) -> dict[str, Any]:
        return self.sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.sd = sd


def varied_state() -> dict[str, Any]:
    """Every kind of node, empty containers, int keys and nesting."""
    return {
        "model": {"weight": torch.ones(2, 3), "bias": torch.zeros(3)},
        "optim": {
            "state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.zeros(3)}, 1: {}},
            "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "params": [0, 1]}],
        },
        "sched": Stateful(),
        "floats": [1.5, float("nan"), float("inf"), -float("inf"), -0.0],
        "text": 'ünï "quoted"',
        "flags": (True, False, None),
        "empty": {"d": {}, "l": [], "t": ()},
        "nested": [[[{"deep": 1}]], ()],
        "big": 2**70,
    }


def encoded(state: dict[str, Any]) -> Any:
    """The tree of ``state`` as a manifest stores it."""
    return json.loads(json.dumps(flatten(state).tree, allow_nan=False))


def test_plain_values_lists_every_non_tensor_leaf_in_tree_order():
    t = encoded(varied_state())
    assert list(tree.plain_values(t)) == [
        ("optim/state/1", "{}"),
        ("optim/param_groups/0/lr", "0.01"),
        ("optim/param_groups/0/betas/0", "0.9"),
        ("optim/param_groups/0/betas/1", "0.999"),
        ("optim/param_groups/0/params/0", "0"),
        ("optim/param_groups/0/params/1", "1"),
        ("sched/count", "3"),
        ("floats/0", "1.5"),
        ("floats/1", "nan"),
        ("floats/2", "inf"),
        ("floats/3", "-inf"),
        ("floats/4", "-0.0"),
        ("text", '"ünï \\"quoted\\""'),
        ("flags/0", "true"),
        ("flags/1", "false"),
        ("flags/2", "null"),
        ("empty/d", "{}"),
        ("empty/l", "[]"),
        ("empty/t", "()"),
        ("nested/0/0/0/deep", "1"),
        ("nested/1", "()"),
        ("big", str(2**70)),
    ]


@pytest.mark.parametrize(
    ("t", "values"),
    [
        ({"V": 1}, [("<root>", "1")]),
        ({"F": "nan"}, [("<root>", "nan")]),
        ({"D": []}, []),
        ({"L": []}, []),
        (
            {"S": {"D": [["a", {"V": "x"}], [7, {"L": [{"U": []}, {"T": "w"}]}]]}},
            [("a", '"x"'), ("7/0", "()")],
        ),
        ({"U": [{"S": {"V": None}}, {"D": [["", {"V": 0.5}]]}]}, [("0", "null"), ("1/", "0.5")]),
    ],
)
def test_plain_values_of_odd_trees(t, values):
    assert list(tree.plain_values(t)) == values


def test_walk_visits_parents_first_in_tree_order():
    t = encoded(varied_state())
    nodes = list(tree.walk(t))
    assert nodes[0] == ("", tree.DICT, t["D"], 0)
    flat = flatten(varied_state())
    # Each tensor's name is its key path, and the walk meets them in the order flatten did.
    tensors = [(path, body) for path, tag, body, _ in nodes if tag == tree.TENSOR]
    assert [body for _, body in tensors] == flat.names
    assert all(path == body for path, body in tensors)
    # A stateful object's node and its state dict's share a path, one level apart.
    (sched,) = [n for n in nodes if n[1] == tree.STATEFUL]
    inner = nodes[nodes.index(sched) + 1]
    assert (inner[0], inner[1], inner[3]) == ("sched", tree.DICT, sched[3] + 1)
    assert [n[0] for n in tree.walk(t, paths=False)] == [""] * len(nodes)


def test_walk_checks_tensor_references_only_when_given_the_names():
    t = {"D": [["w", {"T": "w"}], ["b", {"T": "b"}]]}
    assert len(list(tree.walk(t))) == 3
    assert len(list(tree.walk(t, tensor_names={"w", "b"}))) == 3
    with pytest.raises(tree.MalformedTree, match="unknown tensor 'b'"):
        list(tree.walk(t, tensor_names={"w"}))


def test_the_tags_are_distinct_and_documented():
    tags = [tree.TENSOR, tree.DICT, tree.LIST, tree.TUPLE, tree.STATEFUL, tree.VALUE, tree.FLOAT]
    assert len(set(tags)) == len(tags)
    for tag in tags:
        assert f'{{"{tag}": ' in (tree.__doc__ or "")


def test_format_reexports_the_tree_names():
    assert fmt.check_tree is tree.check_tree
    assert fmt.MAX_TREE_DEPTH == tree.MAX_TREE_DEPTH


def test_check_tree_accepts_what_flatten_builds():
    flat = flatten(varied_state())
    tree.check_tree(encoded(varied_state()), set(flat.names), path="p")


@pytest.mark.parametrize(
    ("t", "why"),
    [
        ([], "node []"),
        ({"V": 1, "T": "w"}, "node "),
        ({"Q": 1}, "unknown tag 'Q'"),
        ({"X": "w"}, "reference to unknown distributed tensor 'w'"),
        ({"N": "missing"}, "reference to unknown tensor 'missing'"),
        ({"G": "w"}, "generator body"),
        ({"G": ["cpu", "missing"]}, "reference to unknown tensor 'missing'"),
        ({"n": ["object", 1]}, "numpy scalar"),
        ({"n": ["float32", [1]]}, "numpy scalar"),
        ({"n": ["float32", "1.5"]}, "numpy scalar"),
        ({"T": "missing"}, "reference to unknown tensor 'missing'"),
        ({"T": ["w"]}, "reference to unknown tensor"),
        ({"D": {}}, "dict body is not a list"),
        ({"D": [["k"]]}, "dict item"),
        ({"D": [[True, {"V": 1}]]}, "dict key True: dict keys must be str or int"),
        ({"D": [[1.5, {"V": 1}]]}, "dict key 1.5"),
        ({"D": [["bad\udcff", {"V": 1}]]}, "lone surrogate"),
        ({"D": [[10**5000, {"V": 1}]]}, "integers are kept up to 4300 decimal digits"),
        ({"L": {}}, "list body is not a list"),
        ({"U": "ab"}, "list body is not a list"),
        ({"V": [1]}, "value [1]: list is not a JSON value"),
        ({"V": 10**5000}, "this one is about 10**5000"),
        ({"V": float("nan")}, "nan is not a JSON number"),
        ({"V": "bad\udcff"}, "lone surrogate"),
        ({"n": ["uint64", 2**1024]}, "numpy scalar"),
        ({"F": "NaN"}, "bad float"),
        ({"F": ["nan"]}, "bad float"),
        ({"S": {"D": [["k", {"L": [7]}]]}}, "node 7"),
    ],
)
def test_check_tree_refuses_malformed_trees(t, why):
    with pytest.raises(CorruptCheckpointError, match="malformed tree") as e:
        tree.check_tree(t, {"w"}, path="root/shard")
    assert str(e.value).startswith("root/shard: malformed tree: ")
    assert why in str(e.value)
    assert e.value.path == "root/shard"


def test_the_walk_is_iterative_and_bounded():
    deep: Any = {"V": 1}
    for _ in range(tree.MAX_TREE_DEPTH):
        deep = {"L": [deep]}
    last = ("0/" * (tree.MAX_TREE_DEPTH - 1) + "0", tree.VALUE, 1, tree.MAX_TREE_DEPTH)
    assert list(tree.walk(deep))[-1] == last
    for _ in range(10_000):  # far past the recursion limit
        deep = {"S": deep}
    with pytest.raises(tree.MalformedTree, match="deeper than"):
        list(tree.walk(deep))


def test_non_finite_floats_round_trip():
    for x in (float("nan"), float("inf"), -float("inf")):
        text = tree.encode_float(x)
        assert text in tree.NON_FINITE
        back = tree.decode_float(str(text))
        assert math.isnan(back) if math.isnan(x) else back == x
    assert tree.encode_float(-0.0) == 0.0
    assert math.copysign(1, tree.encode_float(-0.0)) == -1
    assert tree.encode_float(1e308) == 1e308
    out = unflatten(encoded({"f": [float("nan"), float("-inf")]}), {})
    assert math.isnan(out["f"][0])
    assert out["f"][1] == -float("inf")


def test_manifest_metrics_take_the_same_non_finite_strings():
    # The manager stores a non-finite metric as encode_float does; the manifest check takes
    # exactly those strings.
    for text in tree.NON_FINITE:
        assert values.metric_problem(text) is None
    assert values.metric_problem("NaN") is not None
    assert values.metric_problem(tree.encode_float(float("-inf"))) is None


def test_every_unsupported_value_of_a_state_is_named_in_one_error():
    class Opaque:
        pass

    state = {
        "model": {"w": torch.zeros(2), "bad": Opaque(), 3.5: 1},
        "sparse": torch.zeros(2, 2).to_sparse(),
        "fine": [1, 2, {"nul": "a\x00b"}],
        "ok": torch.ones(1),
    }
    with pytest.raises(UnsupportedValueError) as info:
        flatten(state)
    paths = [p for p, _ in info.value.problems]
    assert paths == ["model/bad", "model/3.5", "sparse", "fine/2/nul"]
    message = str(info.value)
    assert message.startswith("model/bad: values of type")
    assert "and 3 more: model/3.5: dict keys must be str or int" in message
    assert "fine/2/nul: strings with NUL characters" in message
    assert info.value.path == "model/bad"


def test_one_unsupported_value_is_reported_as_before():
    with pytest.raises(UnsupportedValueError) as info:
        flatten({"a": object()})
    assert info.value.problems == [("a", info.value.reason)]
    assert "more" not in str(info.value)


def test_namedtuples_and_dataclasses_are_refused_with_the_fix_in_the_message():
    import collections
    import dataclasses

    Point = collections.namedtuple("Point", "x y")

    @dataclasses.dataclass
    class Config:
        lr: float = 0.1

    class Items(list):
        pass

    with pytest.raises(UnsupportedValueError) as info:
        flatten({"p": Point(1, 2), "c": Config(), "i": Items([1])})
    problems = dict(info.value.problems)
    assert "value._asdict()" in problems["p"]
    assert "dataclasses.asdict(value)" in problems["c"]
    assert "save list(value)" in problems["i"]
    assert flatten({"t": (1, 2), "l": [3]}).tree  # plain ones are fine
