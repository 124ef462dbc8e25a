"""The runtime knobs (``vllm_dspark_pp.envs``): one prefix, typed values read at each access, and
a renamed knob's old name still read for one release with a logged deprecation warning."""

from __future__ import annotations

import logging

import pytest

from vllm_dspark_pp import envs

pytestmark = pytest.mark.quick

NAMES = sorted(envs.environment_variables)


@pytest.fixture
def clean_env(monkeypatch):
    for name in [*NAMES, *envs.deprecated_environment_variables]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(envs, "_warned", set())
    return monkeypatch


@pytest.fixture
def warnings_seen():
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("vllm.dspark_pp.envs")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def test_every_runtime_knob_has_the_one_prefix():
    assert NAMES and all(n.startswith(envs.PREFIX) for n in NAMES), NAMES
    assert all(
        new in envs.environment_variables for new in envs.deprecated_environment_variables.values()
    )
    assert sorted(dir(envs)) == NAMES


def test_defaults_when_unset(clean_env):
    assert envs.VLLM_DSPARK_PP_HANDSHAKE_TIMEOUT_S == 120.0
    assert envs.VLLM_DSPARK_PP_PEER_TIMEOUT_S == 30.0
    assert envs.VLLM_DSPARK_PP_ADMITTED_TIMEOUT_S == 60.0
    assert envs.VLLM_DSPARK_PP_ADAPTIVE_PP is False
    assert envs.VLLM_DSPARK_PP_ADAPTIVE_LAG is None  # chosen from the scheduling
    assert envs.VLLM_DSPARK_PP_SKIP_PATCHES == ""
    assert envs.VLLM_DSPARK_PP_STACKS_ON_SIGUSR1 is False
    assert not any(envs.is_set(n) for n in NAMES)


def test_values_are_read_at_each_access_and_typed(clean_env):
    clean_env.setenv("VLLM_DSPARK_PP_HANDSHAKE_TIMEOUT_S", "7")
    clean_env.setenv("VLLM_DSPARK_PP_PEER_TIMEOUT_S", "0")
    clean_env.setenv("VLLM_DSPARK_PP_ADMITTED_TIMEOUT_S", "2.5")
    clean_env.setenv("VLLM_DSPARK_PP_ADAPTIVE_PP", "1")
    clean_env.setenv("VLLM_DSPARK_PP_SKIP_PATCHES", "a,b")
    clean_env.setenv("VLLM_DSPARK_PP_STACKS_ON_SIGUSR1", "1")
    assert envs.VLLM_DSPARK_PP_HANDSHAKE_TIMEOUT_S == 7.0
    assert envs.VLLM_DSPARK_PP_PEER_TIMEOUT_S == 0.0
    assert envs.VLLM_DSPARK_PP_ADMITTED_TIMEOUT_S == 2.5
    assert envs.VLLM_DSPARK_PP_ADAPTIVE_PP is True
    assert envs.VLLM_DSPARK_PP_SKIP_PATCHES == "a,b"
    assert envs.VLLM_DSPARK_PP_STACKS_ON_SIGUSR1 is True
    clean_env.setenv("VLLM_DSPARK_PP_HANDSHAKE_TIMEOUT_S", "")  # empty: the default, as before
    clean_env.setenv("VLLM_DSPARK_PP_ADAPTIVE_PP", "true")  # only "1" opts in
    assert envs.VLLM_DSPARK_PP_HANDSHAKE_TIMEOUT_S == 120.0
    assert envs.VLLM_DSPARK_PP_ADAPTIVE_PP is False
    clean_env.setenv("VLLM_DSPARK_PP_PEER_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="VLLM_DSPARK_PP_PEER_TIMEOUT_S='soon'"):
        _ = envs.VLLM_DSPARK_PP_PEER_TIMEOUT_S
    with pytest.raises(AttributeError):
        _ = envs.VLLM_DSPARK_PP_NOT_A_KNOB


def test_the_adaptive_lag_is_0_1_2_or_chosen_from_the_scheduling(clean_env):
    from types import SimpleNamespace

    from vllm_dspark_pp.protocol.adaptive_config import resolve_adaptive_lag

    def cfg(async_scheduling):
        return SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=async_scheduling))

    # unset: 2 with async scheduling (a request's next round may be sent before the last stage
    # drafted its previous one), 1 without
    assert resolve_adaptive_lag(cfg(True)) == 2 and resolve_adaptive_lag(cfg(False)) == 1
    assert resolve_adaptive_lag(cfg(None)) == 1
    for text in ("0", "1", "2"):
        clean_env.setenv("VLLM_DSPARK_PP_ADAPTIVE_LAG", text)
        assert envs.VLLM_DSPARK_PP_ADAPTIVE_LAG == int(text)
        assert resolve_adaptive_lag(cfg(True)) == int(text) == resolve_adaptive_lag(cfg(False))
    clean_env.setenv("VLLM_DSPARK_PP_ADAPTIVE_LAG", " ")
    assert envs.VLLM_DSPARK_PP_ADAPTIVE_LAG is None
    for bad in ("3", "yes", "-1"):
        clean_env.setenv("VLLM_DSPARK_PP_ADAPTIVE_LAG", bad)
        with pytest.raises(ValueError, match=f"VLLM_DSPARK_PP_ADAPTIVE_LAG='{bad}'"):
            _ = envs.VLLM_DSPARK_PP_ADAPTIVE_LAG


def test_the_old_stack_dump_name_still_works_and_warns_once(clean_env, warnings_seen):
    clean_env.setenv("DSPARK_PP_STACKS_ON_SIGUSR1", "1")
    assert envs.is_set("VLLM_DSPARK_PP_STACKS_ON_SIGUSR1")
    assert envs.VLLM_DSPARK_PP_STACKS_ON_SIGUSR1 is True
    assert envs.VLLM_DSPARK_PP_STACKS_ON_SIGUSR1 is True
    msgs = [r.getMessage() for r in warnings_seen if r.levelno == logging.WARNING]
    assert len(msgs) == 1, msgs
    assert "DSPARK_PP_STACKS_ON_SIGUSR1 is deprecated" in msgs[0]
    assert "set VLLM_DSPARK_PP_STACKS_ON_SIGUSR1 instead" in msgs[0]


def test_the_new_name_wins_over_the_old_one(clean_env, warnings_seen):
    clean_env.setenv("DSPARK_PP_STACKS_ON_SIGUSR1", "1")
    clean_env.setenv("VLLM_DSPARK_PP_STACKS_ON_SIGUSR1", "0")
    assert envs.VLLM_DSPARK_PP_STACKS_ON_SIGUSR1 is False
    assert len(warnings_seen) == 1  # the old name is still named, so it can be removed


def test_the_old_name_installs_the_stack_dump(clean_env):
    import faulthandler
    import signal

    from vllm_dspark_pp.stack_dumps import install_if_requested

    assert install_if_requested() is False
    clean_env.setenv("DSPARK_PP_STACKS_ON_SIGUSR1", "1")
    try:
        assert install_if_requested() is True
    finally:
        faulthandler.unregister(signal.SIGUSR1)
