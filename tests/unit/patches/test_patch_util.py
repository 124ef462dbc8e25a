"""`patches._util.wrap`: the same patch twice is a no-op; two different patches compose."""

from __future__ import annotations

from vllm_dspark_pp.patches._util import is_patched, original, wrap, wrap_key


def _make_adder(n):
    def make(orig):
        def f(x):
            return orig(x) + n

        return f

    return make


def test_same_wrap_twice_is_a_noop_and_different_wraps_compose():
    class Owner:
        @staticmethod
        def f(x):
            return x

    plus1, plus10 = _make_adder(1), _make_adder(10)
    assert wrap(Owner, "f", plus1, key="plus1") is True
    assert wrap(Owner, "f", plus1, key="plus1") is False  # idempotent
    assert Owner.f(0) == 1
    assert wrap(Owner, "f", plus10, key="plus10") is True  # a second patch still applies
    assert Owner.f(0) == 11
    assert (
        is_patched(Owner, "f")
        and is_patched(Owner, "f", "plus1")
        and is_patched(Owner, "f", "plus10")
    )
    assert original(Owner, "f")(5) == 5


def test_default_key_is_the_make_function():
    def make(orig):
        return lambda self: orig(self) * 2

    class Owner:
        def g(self):
            return 3

    assert wrap(Owner, "g", make)
    assert not wrap(Owner, "g", make)
    assert is_patched(Owner, "g", wrap_key(make))
    assert Owner.g(Owner()) == 6
