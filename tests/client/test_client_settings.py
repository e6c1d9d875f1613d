"""Where Checkpointer settings come from: arguments, operator env, torchrun env, defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierckpt.protocol.contract import Env
from tierckpt.protocol.errors import ContractError, FormatError
from tierckpt.settings import resolve


def test_arguments_win_over_the_environment():
    env = {Env.ROOT: "/env", Env.JOB: "envjob", Env.RANK: "3", Env.WORLD_SIZE: "8", "RANK": "5"}
    s = resolve(root="/arg", job="argjob", rank=1, world_size=2, env=env)
    assert (s.root, s.job, s.rank, s.world_size) == (Path("/arg"), "argjob", 1, 2)


def test_operator_env_wins_over_torchrun_env():
    env = {Env.ROOT: "/env", Env.JOB: "ns_js_abcdef12", Env.RANK: "3", Env.WORLD_SIZE: "8", "RANK": "5"}
    s = resolve(env=env)
    assert (s.root, s.job, s.rank, s.world_size) == (Path("/env"), "ns_js_abcdef12", 3, 8)


def test_torchrun_env_then_defaults():
    s = resolve(env={Env.ROOT: "/r", "RANK": "2", "WORLD_SIZE": "4"})
    assert (s.job, s.rank, s.world_size) == ("local", 2, 4)
    s = resolve(env={Env.ROOT: "/r"})
    assert (s.rank, s.world_size, s.keep, s.on_busy, s.overlap) == (0, 1, 2, "wait", False)


def test_restore_wait_and_replicator_url_come_from_the_environment():
    s = resolve(env={Env.ROOT: "/r", Env.RESTORE_WAIT: "12.5", Env.REPLICATOR_URL: "http://10.0.0.1:8000"})
    assert s.restore_wait == 12.5 and s.replicator_url == "http://10.0.0.1:8000"
    assert resolve(env={Env.ROOT: "/r"}, restore_wait=3).restore_wait == 3


@pytest.mark.parametrize(
    ("kwargs", "env", "error"),
    [
        ({}, {}, ContractError),
        ({}, {Env.ROOT: "/r", Env.RANK: "x"}, ContractError),
        ({"rank": 4, "world_size": 4}, {Env.ROOT: "/r"}, ContractError),
        ({"job": "../etc"}, {Env.ROOT: "/r"}, FormatError),
        ({"keep": 0}, {Env.ROOT: "/r"}, ValueError),
        ({"on_busy": "later"}, {Env.ROOT: "/r"}, ValueError),
    ],
)
def test_bad_settings_are_clear_errors(kwargs, env, error):
    with pytest.raises(error):
        resolve(env=env, **kwargs)
