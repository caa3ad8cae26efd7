"""A faster `__init__` for the frozen, slotted dataclasses built once or more per request.

A frozen dataclass's generated `__init__` stores each field with `object.__setattr__(self, name, value)`
(its own `__setattr__` refuses assignment): a global lookup, an attribute lookup and a call through the
generic attribute machinery per field. `RequestSummary` has 15 fields: 1.35 µs per construction, where
a plain slotted class takes 0.55. `fast_init` replaces the generated `__init__` by one with the same
signature and defaults that stores each field through its slot's own descriptor (`member.__set__`, which
a frozen class's `__setattr__` does not intercept, exactly like `object.__setattr__`): 0.54 µs. Everything
else the dataclass generated (equality, hash, repr, the refusal of assignment, `dataclasses.replace`,
pickling) is untouched. Only classes without `__post_init__`, `InitVar`s, init=False or keyword-only
fields, or default factories qualify (checked: anything else raises at import).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, TypeVar

T = TypeVar("T")


def fast_init(cls: type[T]) -> type[T]:
    """Give the frozen, slotted dataclass `cls` an equivalent `__init__` that sets each slot directly."""
    params = getattr(cls, "__dataclass_params__", None)  # set on every dataclass
    if not dataclasses.is_dataclass(cls) or params is None or not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"{cls.__name__}: fast_init is for frozen dataclasses with slots")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__}: fast_init does not run __post_init__")
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields]
    if list(inspect.signature(cls.__init__).parameters)[1:] != names:  # InitVars, init=False fields
        raise TypeError(f"{cls.__name__}: fast_init needs every field, and only fields, in __init__")
    namespace: dict[str, Any] = {}
    args: list[str] = []
    for f in fields:
        if f.kw_only or f.default_factory is not dataclasses.MISSING:
            raise TypeError(f"{cls.__name__}.{f.name}: fast_init takes no keyword-only fields or factories")
        namespace[f"_set_{f.name}"] = getattr(cls, f.name).__set__
        if f.default is dataclasses.MISSING:
            args.append(f.name)
        else:
            namespace[f"_default_{f.name}"] = f.default
            args.append(f"{f.name}=_default_{f.name}")
    body = "".join(f"    _set_{name}(self, {name})\n" for name in names)
    # Generated from the fields above, as dataclasses itself generates the __init__ it replaces.
    exec(f"def __init__(self, {', '.join(args)}):\n{body}", namespace)  # noqa: S102
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__doc__ = cls.__init__.__doc__
    init.__annotations__ = dict(cls.__init__.__annotations__)
    setattr(cls, "__init__", init)  # the same signature as the one replaced
    return cls
