"""Tool parsers by name (`--tool-call-parser NAME`), and user plugins (`--tool-parser-plugin FILE`)."""
from __future__ import annotations

import importlib.util
import os
import sys
from typing import Callable, TypeVar

T = TypeVar("T", bound=type)

_PARSERS: dict[str, type] = {}


def register_tool_parser(name: str) -> Callable[[T], T]:
    """Class decorator: make a ToolParser subclass available as `--tool-call-parser name`."""
    def register(cls: T) -> T:
        from .engine import ToolParser
        if not (isinstance(cls, type) and issubclass(cls, ToolParser)):
            raise TypeError(f"tool parser {name!r}: {cls!r} is not a subclass of ToolParser")
        cls.name = name
        _PARSERS[name] = cls
        return cls
    return register


def tool_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_tool_parser(name: str) -> type:
    try:
        return _PARSERS[name]
    except KeyError:
        raise KeyError(f"unknown tool call parser {name!r}; available: {', '.join(tool_parser_names())} "
                       "(or register your own with --tool-parser-plugin FILE)") from None


def import_tool_parser_plugin(path: str) -> None:
    """Run a user's Python file; its @register_tool_parser classes become available by name."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--tool-parser-plugin: no such file {path!r}")
    module_name = "jaxserve_tool_parser_plugin_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"--tool-parser-plugin: cannot import {path!r} (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
