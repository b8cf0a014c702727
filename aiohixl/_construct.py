"""Classes users receive from the library but never make themselves."""

from __future__ import annotations

from typing import Any, NoReturn, TypeVar

T = TypeVar("T")


class NoPublicConstructor(type):
    """``Cls(...)`` raises TypeError naming where such objects come from (``made_by``);
    the library makes them with ``Cls.construct(...)``."""

    made_by: str

    def __call__(cls, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(f"aiohixl.{cls.__qualname__} objects are not made directly: {cls.made_by} makes them")

    def construct(cls: type[T], *args: Any, **kwargs: Any) -> T:
        return super().__call__(*args, **kwargs)  # type: ignore[misc]
