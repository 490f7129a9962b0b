"""Lazy packages (PEP 562): what their ``__getattr__`` shares."""

from importlib import import_module


def submodule(package: str, name: str):
    """``package.name`` imported on first attribute access (PEP 562 ``__getattr__`` of a lazy package), or
    ``AttributeError`` when there is no such submodule; an import error inside an existing one is raised as is."""
    try:
        return import_module(f".{name}", package)
    except ModuleNotFoundError as e:
        if e.name != f"{package}.{name}":
            raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
