"""Name -> factory tables for losses, penalties, optimizers and schedules."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from graphkit.errors import UnknownNameError

T = TypeVar("T")
# a factory, registered with its own signature kept for its direct callers
F = TypeVar("F", bound=Callable[..., Any])


def _key(name: str) -> str:
    return name.lower().replace("-", "_")


_HINTS: list[Callable[[str, object], str]] = []


def add_unknown_name_hint(hint: Callable[[str, object], str]) -> None:
    """Have the error for an unknown name end with ``hint(kind, name)`` (``""``: nothing).

    A layer above the registries adds what it knows of names that are no registered
    ones: the seed API (:mod:`graphkit.seed`) says which of its classes a seed name is.
    """
    if hint not in _HINTS:
        _HINTS.append(hint)


def _hints(kind: str, name: object) -> str:
    return "".join(hint(kind, name) for hint in _HINTS)


class Registry(Generic[T]):
    """Factories registered under a canonical name and aliases.

    >>> schedules = Registry("schedule")
    >>> @schedules.register("constant", "fixed")
    ... def constant(value=0.01): ...
    >>> schedules.names()
    ['constant']
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[..., T]] = {}
        self._aliases: dict[str, str] = {}
        self._spellings: dict[str, list[str]] = {}

    def register(self, name: str, *aliases: str) -> Callable[[F], F]:
        """Register the decorated factory as ``name`` (and ``aliases``)."""

        def decorate(factory: F) -> F:
            if not name.isidentifier():
                raise ValueError(f"{self.kind} name {name!r} must be a Python identifier")
            for key in (name, *aliases):
                if _key(key) in self._aliases:
                    raise ValueError(f"{self.kind} {key!r} is already registered")
                self._aliases[_key(key)] = name
            self._factories[name] = factory
            self._spellings[name] = list(aliases)
            return factory

        return decorate

    def canonical(self, name: str) -> str:
        """The registered name behind ``name`` or an alias; raise if unknown."""
        try:
            return self._aliases[_key(name)]
        except (KeyError, AttributeError):
            listed = "; ".join(
                f"{n} ({', '.join(self._spellings[n])})" if self._spellings[n] else n
                for n in self.names()
            )
            raise UnknownNameError(
                f"Unknown {self.kind} {name!r}. Valid names (aliases): {listed}."
                + _hints(self.kind, name)
            ) from None

    def get(self, name: str, **kwargs: object) -> T:
        """Build the registered object ``name`` with ``kwargs``."""
        return self._factories[self.canonical(name)](**kwargs)

    def factory(self, name: str) -> Callable[..., T]:
        """The factory registered as ``name`` (or an alias)."""
        return self._factories[self.canonical(name)]

    def names(self) -> list[str]:
        return sorted(self._factories)

    def spellings(self) -> dict[str, str]:
        """``{every accepted name or alias: the registered name it means}``."""
        return {
            spelling: name for name in self.names() for spelling in (name, *self._spellings[name])
        }

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and _key(name) in self._aliases
