import gc
import logging

import pytest

from proxy.gcsettings import ENV, GEN0, tune_gc


@pytest.fixture
def gc_state(monkeypatch):
    """The process's collector settings are restored after each test (freeze included)."""
    monkeypatch.delenv(ENV, raising=False)
    threshold = gc.get_threshold()
    frozen = gc.get_freeze_count()
    yield
    if gc.get_freeze_count() > frozen:
        gc.unfreeze()
    gc.set_threshold(*threshold)


def test_serving_settings_freeze_start_up_and_raise_generation_0(gc_state):
    gc.set_threshold(700, 10, 10)
    gc.unfreeze()
    built = [object(), {"a": [1]}]  # something start-up made
    tune_gc()
    assert gc.get_threshold() == (GEN0, 10, 10)
    assert gc.get_freeze_count() > 0
    made = built[1]
    assert gc.is_tracked(made)
    # in the permanent generation: no collection traverses it any more
    assert not any(o is made for g in (0, 1, 2) for o in gc.get_objects(generation=g))


def test_default_keeps_cpython_settings(gc_state):
    gc.set_threshold(700, 10, 10)
    gc.unfreeze()
    tune_gc("default")
    assert gc.get_threshold() == (700, 10, 10)
    assert gc.get_freeze_count() == 0


def test_environment_sets_generation_0(gc_state, monkeypatch):
    gc.unfreeze()
    monkeypatch.setenv(ENV, "1234")
    tune_gc()
    assert gc.get_threshold()[0] == 1234
    assert gc.get_freeze_count() > 0
    gc.unfreeze()
    monkeypatch.setenv(ENV, " Default ")
    tune_gc()
    assert gc.get_threshold()[0] == 1234  # untouched
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("bad", ["x", "0", "-5", "1.5"])
def test_a_bad_value_warns_and_uses_the_serving_default(gc_state, caplog, bad):
    with caplog.at_level(logging.WARNING, logger="affinity_proxy"):
        tune_gc(bad)
    assert gc.get_threshold()[0] == GEN0
    assert ENV in caplog.text and repr(bad) in caplog.text
