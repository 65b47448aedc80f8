"""Packages that import their exports on first use, so that importing one side (the runtime) never
loads the other (the lowering side, the writer)."""

from __future__ import annotations

import sys
from importlib import import_module


def lazy_exports(package: str, exports: dict[str, str]):
    """A package's module-level ``__getattr__`` and ``__dir__``: ``exports`` maps each exported name to
    the submodule (relative to ``package``) that defines it, imported when the name is first read."""
    namespace = vars(sys.modules[package])

    def __getattr__(name):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(f".{module}", package), name)
        namespace[name] = value
        return value

    def __dir__():
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
