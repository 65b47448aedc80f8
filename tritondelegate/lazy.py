"""Packages that import their exports on first use, so that importing one side (the runtime) never
loads the other (the lowering side, the writer)."""

from __future__ import annotations

import sys
import types
from importlib import import_module


class _Package(types.ModuleType):
    """A package with an export named as the submodule that defines it (``tritondelegate.lower``, the
    function, from ``tritondelegate/lower.py``). Importing a submodule binds its name on the package
    (``from tritondelegate.lower import LoweredProgram`` would make ``td.lower`` the module): here that
    binding is skipped, and the name stays the export."""

    def __setattr__(self, name, value):
        if isinstance(value, types.ModuleType) and value.__name__ == f"{self.__name__}.{name}" and \
                name in self.__dict__.get("_same_name_exports", ()):
            return
        super().__setattr__(name, value)


def lazy_exports(package: str, exports: dict[str, str]):
    """A package's module-level ``__getattr__`` and ``__dir__``: ``exports`` maps each exported name to
    the submodule (relative to ``package``) that defines it, imported when the name is first read. An
    export named as its submodule keeps its name when the submodule is imported (:class:`_Package`)."""
    module_object = sys.modules[package]
    namespace = vars(module_object)
    namespace["_same_name_exports"] = frozenset(name for name, module in exports.items() if name == module)
    module_object.__class__ = _Package

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
