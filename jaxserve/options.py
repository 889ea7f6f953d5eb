"""Options declared once, on the config dataclasses: a field's default, choices and help text become its
command-line flag, its key in a ``--config`` YAML file and its ``LLM(...)`` keyword argument.

A field is declared with ``option(default, help=...)``; a field holding a nested options dataclass with
``section(cls, title)``. Options are set flat (``block_size``, not ``cache.block_size``), so a name is unique
across the sections of one class. The flag is ``--name-with-dashes`` unless the caller's table of flag names
says otherwise; a ``bool`` becomes ``--name`` / ``--no-name``."""
from __future__ import annotations

import argparse
import dataclasses
import json
import difflib
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping


@dataclass(frozen=True)
class Option:
    """How a field is set from outside its dataclass."""
    help: str
    choices: tuple | None = None
    type: Callable[[str], Any] | None = None   # argparse's, per word; default: the field's int / float / str
    nargs: str | None = None
    metavar: str | None = None
    # the parsed flag's (or YAML key's) value -> the field's value; keyword arguments are taken as they are
    convert: Callable[[Any], Any] | None = None
    flag: bool = True            # False: no flag of its own (a keyword argument, or set by a like-named flag)
    group: str | None = None     # its --help section; default: the one of its dataclass


def option(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING, help: str,
           **kw: Any) -> Any:
    """A dataclass field that is an option (``Option``'s fields as keywords)."""
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={"option": Option(help, **kw)})


def section(cls: type, title: str) -> Any:
    """A dataclass field holding the options dataclass ``cls``; ``title`` heads its flags in --help."""
    return dataclasses.field(default_factory=cls, metadata={"section": title})


@dataclass(frozen=True)
class Declared:
    """One option of an options dataclass, found by ``options_of``."""
    name: str                    # the field's name: keyword argument, YAML key, argparse dest
    field: dataclasses.Field
    option: Option
    hint: Any                    # the field's resolved annotation
    group: str

    @property
    def default(self) -> Any:
        f = self.field
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def options_of(cls: type, title: str = "options") -> Iterator[Declared]:
    """Every option of ``cls`` and of its sections, in field order. A field that is neither is an error."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if "section" in f.metadata:
            yield from options_of(f.default_factory, f.metadata["section"])
        elif "option" in f.metadata:
            opt = f.metadata["option"]
            yield Declared(f.name, f, opt, hints[f.name], opt.group or title)
        else:
            raise TypeError(f"{cls.__name__}.{f.name} is neither an option(...) nor a section(...)")


def flag_names(name: str, spellings: Mapping[str, tuple[str, ...]] | None = None) -> tuple[str, ...]:
    """The flags of option ``name``: its entry in ``spellings``, else ``--name-with-dashes``."""
    return (spellings or {}).get(name) or ("--" + name.replace("_", "-"),)


def _scalar(hint: Any) -> Any:
    """int for ``int`` or ``int | None`` (likewise float, str, bool); None for anything else."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    args = [a for a in typing.get_args(hint) if a is not type(None)] if union else [hint]
    return args[0] if len(args) == 1 and args[0] in (int, float, str, bool) else None


def _default_note(help: str, default: Any) -> str:
    if "default" in help:
        return ""                                  # the help says it
    if isinstance(default, bool):
        return f" (default: {'on' if default else 'off'})"
    if default is None or (not isinstance(default, (int, float)) and not default):
        return ""                                  # the help says what no value means
    return " (default: %(default)s)"


def argparse_kwargs(o: Declared) -> dict[str, Any]:
    """``add_argument`` keywords for option ``o``: its default, choices, help and how its words parse."""
    opt, scalar, default = o.option, _scalar(o.hint), o.default
    kw: dict[str, Any] = {"dest": o.name, "default": default,
                          "help": opt.help.replace("%", "%%") + _default_note(opt.help, default)}
    if scalar is bool:
        return {**kw, "action": argparse.BooleanOptionalAction}
    typ = opt.type or (scalar if scalar in (int, float) else None)
    if typ is None and scalar is not str and opt.nargs is None:
        raise TypeError(f"option {o.name} ({o.hint}): say how its flag's words parse (option(type=...))")
    for key, value in (("type", typ), ("choices", opt.choices), ("nargs", opt.nargs), ("metavar", opt.metavar)):
        if value is not None:
            kw[key] = value
    return kw


def add_options(parser: argparse.ArgumentParser, cls: type, title: str,
                spellings: Mapping[str, tuple[str, ...]] | None = None) -> argparse.ArgumentParser:
    """Add a flag for each option of ``cls`` to ``parser``, in argument groups by section."""
    groups: dict[str, Any] = {}
    for o in options_of(cls, title):
        if o.option.flag:
            if o.group not in groups:
                groups[o.group] = parser.add_argument_group(o.group)
            groups[o.group].add_argument(*flag_names(o.name, spellings), **argparse_kwargs(o))
    return parser


def _build(cls: type, values: Mapping[str, Any]) -> Any:
    kw = {}
    for f in dataclasses.fields(cls):
        if "section" in f.metadata:
            kw[f.name] = _build(f.default_factory, values)
        elif f.name in values:
            kw[f.name] = values[f.name]
    return cls(**kw)


def from_namespace(cls: type, ns: argparse.Namespace) -> Any:
    """``cls`` from parsed flags: each option ``ns`` has, through its ``convert``; an absent or None one keeps
    its default."""
    values = {}
    for o in options_of(cls):
        value = getattr(ns, o.name, None)
        if value is not None:
            values[o.name] = o.option.convert(value) if o.option.convert else value
    return _build(cls, values)


def unknown_option(name: str, known: typing.Iterable[str]) -> str:
    """The message for an unknown option ``name``, with the nearest known name."""
    close = difflib.get_close_matches(name, list(known), n=1)
    return f"unknown option {name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")


def from_kwargs(cls: type, kwargs: Mapping[str, Any], caller: str) -> Any:
    """``cls`` from flat keyword arguments (an option of a section by its own name); an unknown name is a
    TypeError that names it."""
    known = {o.name for o in options_of(cls)}
    for name in kwargs:
        if name not in known:
            raise TypeError(f"{caller} got an {unknown_option(name, known)}")
    return _build(cls, kwargs)


def json_dict(value: Any) -> dict:
    """A JSON object (``'{"image": 2}'``), or a dict already (LLM keyword arguments, YAML)."""
    if isinstance(value, dict):
        return dict(value)
    try:
        out = json.loads(value)
    except (TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"expected a JSON object, got {value!r} ({e})") from None
    if not isinstance(out, dict):
        raise ValueError(f"expected a JSON object, got {value!r}")
    return out
