"""In-process fuzz of the codec every boundary parses with (the control API's bodies, the data plane's
frames, the files in job trees): whatever the bytes, ``Message.from_bytes`` returns a valid message or
raises ``FormatError``, never anything else (a RecursionError, an OverflowError, a pydantic error, a
UnicodeDecodeError would each be a 500 or a traceback at a boundary). The end-to-end fuzz against a
real replicator is tests/replicator/test_fuzz.py."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fixtures.fuzzing import HOSTILE_TEXT, fuzz_settings
from tierckpt.protocol import api
from tierckpt.protocol.codec import Message
from tierckpt.protocol.control import JobPolicy, PeerAssignment, PeerNode, RestorePlan, Tier
from tierckpt.protocol.errors import FormatError

MESSAGES = sorted(
    {cls for ep in api.ENDPOINTS for cls in (ep.request, ep.response) if cls is not None}, key=str
)
JOB = "ns_job_0123abcd"
VALID: dict[type[Message], Message] = {
    PeerAssignment: PeerAssignment(
        job=JOB,
        generation=3,
        nodes={"a": PeerNode("a", "https://10.0.0.1:8470"), "b": PeerNode("b", "https://10.0.0.2:8470")},
        peers={"a": ("b",), "b": ("a",)},
        node_ranks={"a": 0, "b": 1},
        procs_per_node=1,
    ),
    JobPolicy: JobPolicy(job=JOB, generation=2, bucket="bkt"),
    RestorePlan: RestorePlan(
        job=JOB, step=5, world_size=2, sources={0: Tier.LOCAL, 1: Tier.PEER}, generation=1
    ),
}

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([10**400, -(2**63) - 1, 2**63, 2**64])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.sampled_from(HOSTILE_TEXT),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def parses_or_refuses(cls: type[Message], data: bytes) -> None:
    try:
        msg = cls.from_bytes(data)
    except FormatError:
        return
    assert cls.from_bytes(msg.to_bytes()) == msg  # what it accepts, it writes back the same


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.__name__)
@fuzz_settings(150)
@given(data=st.binary(max_size=300) | st.sampled_from([b"[" * 200_000, b'{"a":' * 50_000, b"\xff\xfe{}"]))
def test_any_bytes_parse_or_raise_format_error(cls, data):
    parses_or_refuses(cls, data)


@pytest.mark.parametrize("cls", sorted(VALID, key=str), ids=lambda c: c.__name__)
@fuzz_settings(300)
@given(data=st.data())
def test_a_valid_message_with_hostile_fields_parses_or_raises_format_error(cls, data):
    fields: dict[str, Any] = VALID[cls].to_dict()
    for key in data.draw(st.lists(st.sampled_from([*sorted(fields), "extra"]), min_size=1, max_size=3)):
        current = fields.get(key)
        if isinstance(current, dict) and current and data.draw(st.booleans()):
            inner = dict(current)
            inner[data.draw(st.sampled_from(sorted(inner)) | st.text(max_size=4))] = data.draw(json_values)
            fields[key] = inner  # a hostile node, rank or key inside
        else:
            fields[key] = data.draw(json_values)
    text = json.dumps(fields).encode()  # NaN and Infinity too, as Python's json writes them
    parses_or_refuses(cls, text + data.draw(st.sampled_from([b"", b"\n", b" x"])))


@dataclasses.dataclass(frozen=True)
class _Counts(Message):
    """A message of plain integers (no field narrows their range)."""

    KIND: ClassVar[str] = "tierckpt.test-counts"
    value: int
    by_rank: dict[int, int] = dataclasses.field(default_factory=dict)


@pytest.mark.parametrize(
    "number", ["9223372036854775808", "-9223372036854775809", "1e19", "1E+30", "100000000000000000000000"]
)
@pytest.mark.parametrize("where", ["value", "key", "item"])
def test_an_integer_beyond_64_bits_is_refused_however_it_is_written(number, where):
    body = {
        "value": '{"kind":"tierckpt.test-counts","version":1,"value":N,"by_rank":{}}',
        "key": '{"kind":"tierckpt.test-counts","version":1,"value":1,"by_rank":{"N":1}}',
        "item": '{"kind":"tierckpt.test-counts","version":1,"value":1,"by_rank":{"3":N}}',
    }[where]
    with pytest.raises(FormatError):
        _Counts.from_bytes(body.replace("N", number).encode())


def test_an_integer_of_up_to_63_bits_is_kept():
    for n in (999_999_999_999_999_999, (1 << 63) - 1, -(1 << 63)):
        msg = _Counts(value=n, by_rank={n: n})
        assert _Counts.from_bytes(msg.to_bytes()) == msg
