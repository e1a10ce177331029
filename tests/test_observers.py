"""The runtime's observer point (`runtime/observers.py`): the events a watched engine gives, the names loaded from
the environment and from entry points, and what a name that cannot load does."""

import sys
import types

import pytest

from ds_asynchzp.runtime import observers


class FakeEngine:
    def __init__(self):
        self.calls = []

    def forward(self, x):
        self.calls.append("forward")
        return x + 1

    def backward(self, loss, retain_graph=False):
        self.calls.append("backward")

    def step(self):
        self.calls.append("step")
        raise RuntimeError("step failed")


class Log:
    def __init__(self):
        self.events = []

    def __getattr__(self, name):
        if name.endswith(("_begun", "_ended")) or name in ("before_engine", "after_engine"):
            return lambda *args: self.events.append((name, *args[1:]))
        raise AttributeError(name)


@pytest.fixture
def clean(monkeypatch):
    monkeypatch.setattr(observers, "_observers", [])
    monkeypatch.setattr(observers, "_names_loaded", set())
    return monkeypatch


def test_a_watched_engine_reports_each_call_in_order_and_no_end_after_a_failure(clean):
    engine, log = FakeEngine(), Log()
    observers.watch_engine(engine, log)
    assert engine.forward(1) == 2
    engine.backward("the loss", retain_graph=True)
    engine.backward(loss="keyword loss")
    with pytest.raises(RuntimeError, match="step failed"):
        engine.step()
    assert log.events == [("forward_begun",), ("forward_ended",), ("backward_begun", "the loss"), ("backward_ended",),
                          ("backward_begun", "keyword loss"), ("backward_ended",), ("step_begun",)]
    assert engine.calls == ["forward", "backward", "backward", "step"]


def test_observers_see_engine_construction_once_each(clean):
    log = Log()
    observers.add_observer(log)
    observers.add_observer(log)
    observers.before_engine({"a": 1})
    observers.after_engine("engine", {"a": 1})
    observers.remove_observer(log)
    observers.before_engine({})
    assert log.events == [("before_engine",), ("after_engine", {"a": 1})]


def test_named_observers_load_once_from_the_environment(clean):
    made = []
    module = types.ModuleType("fake_observer_tool")
    module.make = lambda: made.append(Log()) or made[-1]
    module.nothing = lambda: None
    clean.setitem(sys.modules, "fake_observer_tool", module)
    clean.setenv(observers.ENVIRONMENT_VARIABLE, "fake_observer_tool:make, fake_observer_tool:nothing,")
    observers.before_engine({"k": 1})
    observers.before_engine({"k": 2})
    assert len(made) == 1 and made[0].events == [("before_engine",), ("before_engine",)]


@pytest.mark.parametrize("name", ["no_colon_here", "no_such_module_xyz:make", "fake_observer_tool:missing"])
def test_a_name_in_the_environment_that_cannot_load_is_an_error_naming_it(clean, name):
    clean.setitem(sys.modules, "fake_observer_tool", types.ModuleType("fake_observer_tool"))
    clean.setenv(observers.ENVIRONMENT_VARIABLE, name)
    with pytest.raises(ValueError, match=f"observer '{name}'.*{observers.ENVIRONMENT_VARIABLE}"):
        observers.before_engine({})


def test_an_entry_point_that_cannot_load_is_skipped_with_a_warning(clean):
    clean.delenv(observers.ENVIRONMENT_VARIABLE, raising=False)
    clean.setattr(observers, "observer_names", lambda: [("no_such_module_xyz:make", "entry point 'x'")])
    with pytest.warns(RuntimeWarning, match="no_such_module_xyz:make.*skipped"):
        observers.before_engine({})


def test_the_installed_package_names_the_ab_recorder_and_ab_names_it_too(clean):
    """asynchzp-ab's recorder reaches ranks started with or without the tool's environment."""
    from ds_asynchzp.bench import ab

    clean.delenv(observers.ENVIRONMENT_VARIABLE, raising=False)
    names = dict(observers.observer_names())
    assert ab.RECORDER in names, f"the package's entry point is missing (reinstall it): {names}"
    assert ab._arm_environment("asynchzp")[observers.ENVIRONMENT_VARIABLE] == ab.RECORDER
    clean.setenv(observers.ENVIRONMENT_VARIABLE, "x:y")
    assert ab._arm_environment("asynchzp")[observers.ENVIRONMENT_VARIABLE] == "x:y," + ab.RECORDER
    assert ab._arm_environment("asynchzp")[ab.ARM_VARIABLE] == "asynchzp"
