"""The state tree encoding (snapshot.flatten): exact round trips and in-place restore, no I/O."""

from __future__ import annotations

import collections
import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.client.client_helpers import assert_same, training_state
from tierckpt.protocol.errors import FormatError
from tierckpt.snapshot.flatten import flatten, restore_into


def roundtrip(state, dest=None):
    flat = flatten(state)
    tree = json.loads(json.dumps(flat.tree))  # what the manifest stores
    dest = {} if dest is None else dest

    def fill(i, existing):
        src = flat.tensors[i]
        if existing is not None and existing.shape == src.shape and existing.dtype == src.dtype:
            with torch.no_grad():
                existing.copy_(src)
            return existing
        return src.detach().clone()

    restore_into(dest, tree, fill=fill, n_tensors=len(flat.tensors), objects=list(flat.objects))
    return dest, flat


def test_training_state_round_trips_exactly():
    state = training_state()
    dest, flat = roundtrip(state)
    assert_same(state, dest)
    assert flat.objects  # the set, bytes, dtype and Size went to objects.pkl


def test_tree_encodes_scalars_inline_and_floats_exactly():
    flat = flatten({"f": 0.1, "i": 2**60, "b": True, "n": None, "s": "x", "k": {3: 1}})
    items = dict((k, v) for k, v in flat.tree["v"])
    assert items["f"] == {"t": "float", "v": (0.1).hex()}
    assert items["i"] == {"t": "int", "v": str(2**60)}
    assert items["b"] is True and items["n"] is None and items["s"] == "x"
    assert items["k"] == {"t": "dict", "v": [[3, 1]]}
    assert flat.tree["t"] == "dict" and not flat.objects and not flat.tensors


def test_tensor_keys_are_readable_paths_and_unique():
    state = {"model": {"0.weight": torch.zeros(1)}, "opt": {"state": {0: {"exp_avg": torch.zeros(1)}}}}
    state["model/0.weight"] = torch.zeros(1)  # collides with the nested path
    flat = flatten(state)
    assert flat.keys == ("model/0.weight", "opt/state/0/exp_avg", "model/0.weight#1")


def test_restore_fills_existing_tensors_in_place_and_keeps_identity():
    state = training_state(seed=1)
    fresh = training_state(seed=2)
    weight = fresh["model"]["0.weight"]
    exp_avg = fresh["optim"]["state"][0]["exp_avg"]
    fresh["only_in_dest"] = 42
    dest, _ = roundtrip(state, fresh)
    assert dest is fresh
    assert dest["model"]["0.weight"] is weight and torch.equal(weight, state["model"]["0.weight"])
    assert dest["optim"]["state"][0]["exp_avg"] is exp_avg
    assert dest["only_in_dest"] == 42
    del dest["only_in_dest"]
    assert_same(state, dest)


def test_restore_replaces_tensors_of_another_shape_and_containers_of_another_type():
    dest = {"t": torch.zeros(3), "l": (1, 2), "d": [1]}
    out, _ = roundtrip({"t": torch.ones(5), "l": [1, 2, 3], "d": {"k": 1}}, dest)
    assert out["t"].shape == (5,) and out["l"] == [1, 2, 3] and out["d"] == {"k": 1}


def test_lists_are_updated_in_place():
    keep = [torch.zeros(2), 5, 6]
    dest = {"l": keep}
    roundtrip({"l": [torch.ones(2)]}, dest)
    assert dest["l"] is keep and len(keep) == 1 and torch.equal(keep[0], torch.ones(2))


def test_numpy_arrays_round_trip_as_arrays_and_fill_in_place():
    arr = np.zeros((2, 3), dtype=np.int16)
    dest = {"a": arr}
    roundtrip({"a": np.arange(6, dtype=np.int16).reshape(2, 3)}, dest)
    assert dest["a"] is arr and arr.tolist() == [[0, 1, 2], [3, 4, 5]]
    odd = np.arange(4, dtype=">i4")  # big-endian: not storable as raw tensor bytes, pickled instead
    out, flat = roundtrip({"a": odd})
    assert out["a"].dtype == odd.dtype and flat.objects


def test_sharded_tensors_are_refused_with_a_pointer_to_dcp():
    """A ShardedTensor (the older distributed tensor) is refused; DTensors are saved as local shards
    (tests/client/test_client_dtensor.py)."""

    class ShardedTensor(torch.Tensor):
        pass

    fake = torch.Tensor._make_subclass(ShardedTensor, torch.zeros(2))
    with pytest.raises(TypeError, match=r"tierckpt\.dcp"):
        flatten({"w": fake})


def test_state_must_be_a_dict_and_malformed_trees_are_format_errors():
    with pytest.raises(TypeError):
        flatten([torch.zeros(1)])  # type: ignore[arg-type]
    for bad in (
        {"t": "list", "v": []},
        {"t": "dict", "v": [[1]]},
        {"t": "dict", "v": [["k", {"t": "nope"}]]},
    ):
        with pytest.raises(FormatError):
            restore_into({}, bad, fill=lambda i, e: None, n_tensors=0, objects=[])
    with pytest.raises(FormatError, match="out of range"):
        restore_into(
            {}, {"t": "dict", "v": [["k", {"t": "tensor", "i": 3}]]}, fill=None, n_tensors=1, objects=[]
        )


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)
keys = st.one_of(st.text(max_size=5), st.integers(-5, 5), st.tuples(st.integers(0, 3), st.text(max_size=2)))
trees = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(keys, children, max_size=4),
        st.dictionaries(keys, children, max_size=4).map(collections.OrderedDict),
    ),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(keys, trees, max_size=4))
def test_any_nesting_of_json_scalars_round_trips_exactly_without_pickle(state):
    dest, flat = roundtrip(state)
    assert_same(state, dest)
    assert not flat.objects


def test_float_encoding_is_bit_exact_for_edge_values():
    values = [5e-324, -0.0, math.pi, 1.7976931348623157e308, float("nan")]
    dest, _ = roundtrip({"v": values})
    assert [v.hex() for v in dest["v"]] == [v.hex() for v in values]
