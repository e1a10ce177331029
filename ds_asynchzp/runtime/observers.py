"""The one point where tools watch training: the runtime calls observers, and knows none of them.

An observer is any object with some of these methods (each optional):

* ``before_engine(ds_config)``: in `initialize`, before DeepSpeed builds the engine (the ds_config as a dict);
* ``after_engine(engine, ds_config)``: the engine built, every engine (with or without an optimizer, stock or
  AsyncHZP). To see that engine's training calls it calls `watch_engine(engine, self)`;
* ``forward_begun(engine)`` / ``forward_ended(engine)``, ``backward_begun(engine, loss)`` /
  ``backward_ended(engine)``, ``step_begun(engine)`` / ``step_ended(engine)``: around the engine's ``forward``,
  ``backward`` and ``step`` for a watched engine; an ``*_ended`` call only follows a call that returned, an
  ``*_failed(engine)`` call (``forward_failed``, ...) one that raised, before the exception goes on.

An observer is added with `add_observer` (``ds_asynchzp.add_observer``), or, from outside a script that is not to
be changed, by name: ``module:factory``, in the environment variable ``DS_ASYNCHZP_OBSERVERS`` (comma-separated)
or as an entry point of the group ``ds_asynchzp.observers`` of an installed package (which reaches ranks that a
launcher starts without the caller's environment, such as the ``deepspeed`` launcher's pdsh). Each name is loaded
once per process, at the first `initialize`; its factory is called without arguments and returns an observer or
None. This is how ``asynchzp-ab`` records each arm inside the user's own job (the package names its recorder
both ways; the recorder does nothing unless the ds_config asks for it).

Importing this module imports neither DeepSpeed nor torch.
"""

from __future__ import annotations

import importlib
import os
import warnings

ENVIRONMENT_VARIABLE = "DS_ASYNCHZP_OBSERVERS"
ENTRY_POINT_GROUP = "ds_asynchzp.observers"
ENGINE_EVENTS = ("forward", "backward", "step")

_observers: list = []
_names_loaded: set = set()


def add_observer(observer) -> None:
    """Call `observer` at every event from now on (once, however often it is added)."""
    if not any(o is observer for o in _observers):
        _observers.append(observer)


def remove_observer(observer) -> None:
    _observers[:] = [o for o in _observers if o is not observer]


def observer_names() -> list:
    """The ``module:factory`` names to load, each with where it was named: the environment variable's, then the
    installed entry points'."""
    from importlib.metadata import entry_points

    named = {part.strip(): ENVIRONMENT_VARIABLE for part in os.environ.get(ENVIRONMENT_VARIABLE, "").split(",")
             if part.strip()}
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        named.setdefault(entry.value.replace(" ", ""), f"entry point {entry.name!r} of {ENTRY_POINT_GROUP!r}")
    return list(named.items())


def _load_named() -> None:
    """Each named observer factory, once per process (a name given both ways is loaded once). One the user named
    in the environment must load; an installed entry point that does not (a stale install) is skipped with a
    warning, as training does not depend on it."""
    for name, source in observer_names():
        if name in _names_loaded:
            continue
        _names_loaded.add(name)
        module_name, _, factory_name = name.partition(":")
        try:
            if not module_name or not factory_name:
                raise ValueError("not 'module:factory' (for example 'my_tools.watch:make_observer')")
            factory = getattr(importlib.import_module(module_name), factory_name)
        except (ImportError, AttributeError, ValueError) as err:
            message = f"observer {name!r} ({source}) cannot be loaded: {err}"
            if source == ENVIRONMENT_VARIABLE:
                raise ValueError(f"{message}; fix or unset {ENVIRONMENT_VARIABLE}") from err
            warnings.warn(f"{message}; skipped (reinstall the package that declares it)", RuntimeWarning)
            continue
        observer = factory()
        if observer is not None:
            add_observer(observer)


def _call(method: str, *args) -> None:
    for observer in list(_observers):
        callback = getattr(observer, method, None)
        if callback is not None:
            callback(*args)


def before_engine(ds_config: dict) -> None:
    _load_named()
    _call("before_engine", ds_config)


def after_engine(engine, ds_config: dict) -> None:
    _call("after_engine", engine, ds_config)


def watch_engine(engine, observer) -> None:
    """Route `engine`'s forward, backward and step through `observer`'s begun/ended methods. The wrappers are
    instance attributes, so every caller (a framework's wrapper too) goes through them."""
    for event in ENGINE_EVENTS:
        setattr(engine, event, _watched(engine, event, getattr(engine, event), observer))


def _watched(engine, event: str, call, observer):
    begun = getattr(observer, f"{event}_begun", None)
    ended = getattr(observer, f"{event}_ended", None)
    failed = getattr(observer, f"{event}_failed", None)

    def watched(*args, **kwargs):
        if begun is not None:
            if event == "backward":
                begun(engine, args[0] if args else kwargs.get("loss"))
            else:
                begun(engine)
        try:
            result = call(*args, **kwargs)
        except BaseException:
            if failed is not None:
                failed(engine)
            raise
        if ended is not None:
            ended(engine)
        return result

    watched.__wrapped__ = call
    return watched
