"""`fast_init`: the same objects as the dataclass's own frozen __init__, built faster (proxy/core/frozen.py)."""

from __future__ import annotations

import dataclasses
import inspect
import pickle

import pytest

from proxy.core.decision import Decision, Reason
from proxy.core.frozen import fast_init
from proxy.core.request import RequestSummary


def _generated(cls: type) -> type:
    """The same class as dataclasses builds it, without fast_init."""
    return dataclasses.dataclass(frozen=True, slots=True)(
        type(cls.__name__, (), {"__annotations__": dict(cls.__annotations__),
                                **{f.name: f for f in dataclasses.fields(cls)}, "__module__": cls.__module__}))


@pytest.mark.parametrize("cls", [RequestSummary, Decision])
def test_same_signature_fields_and_values_as_the_generated_init(cls: type) -> None:
    plain = _generated(cls)
    assert inspect.signature(cls.__init__) == inspect.signature(plain.__init__)
    assert cls.__init__.__code__.co_filename == "<string>"  # fast_init's, not dataclasses'
    names = [f.name for f in dataclasses.fields(cls)]
    if cls is RequestSummary:
        args = [{"prompt": "p", "model": "m", "max_tokens": 3, "temperature": -0.0, "media": (1, 2),
                 "key_prefix_chars": 1, "messages": ({"role": "user"},), "state_home": "b"},
                {"prompt": ""}]
    else:
        args = [{"backend": "b", "reason": Reason.HASH, "policy": "affinity"},
                {"backend": "b", "reason": Reason.EXACT_HIT, "policy": "affinity", "prefix_blocks_matched": 7}]
    for kw in args:
        fast, slow = cls(**kw), plain(**kw)
        assert [getattr(fast, n) for n in names] == [getattr(slow, n) for n in names]
        positional = cls(*[getattr(slow, n) for n in names])
        assert positional == fast and hash(positional) == hash(fast)
        assert repr(fast).split("(", 1)[1] == repr(slow).split("(", 1)[1]
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(fast, names[0], None)  # assignment is still refused
        assert pickle.loads(pickle.dumps(fast)) == fast
    with pytest.raises(TypeError):
        cls()  # the required field is required


def test_replace_goes_through_the_fast_init() -> None:
    s = RequestSummary(prompt="p", model="m")
    r = dataclasses.replace(s, state_home="b")
    assert (r.prompt, r.model, r.state_home) == ("p", "m", "b") and s.state_home is None


def test_classes_it_cannot_reproduce_are_refused() -> None:
    @dataclasses.dataclass(frozen=True, slots=True)
    class Post:
        a: int

        def __post_init__(self) -> None:
            pass

    @dataclasses.dataclass(frozen=True, slots=True)
    class Factory:
        a: list[int] = dataclasses.field(default_factory=list)

    @dataclasses.dataclass(frozen=True, slots=True)
    class Hidden:
        a: int = dataclasses.field(default=0, init=False)

    @dataclasses.dataclass(slots=True)
    class Mutable:
        a: int

    @dataclasses.dataclass(frozen=True)
    class NoSlots:
        a: int

    for cls in (Post, Factory, Hidden, Mutable, NoSlots):
        with pytest.raises(TypeError):
            fast_init(cls)
