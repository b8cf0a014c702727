from collections.abc import Callable
from typing import Any

class Span:
    region: Any
    offset: int
    nbytes: int
    _sliced_as: type | None
    _what: str
    def __init__(self, region: Any, offset: int, nbytes: int, sliced_as: type | None = None) -> None: ...
    def __len__(self) -> int: ...
    def __getitem__(self, key: slice) -> Any: ...

def set_fallback(fn: Callable[[Any, Any], Any], /) -> None: ...
