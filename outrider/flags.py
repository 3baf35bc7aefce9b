"""Command-line flags generated from the configuration dataclasses.

Each field of a service's config (``outrider.config``) is one flag: its name
(``max_sessions`` → ``--max-sessions``), its type, its default and its help
(the attribute docstring under the field, as vLLM's ``EngineArgs`` reads
them) come from the field, so a default is written once. A field whose type
is itself a config dataclass contributes its own fields, flattened. Every
flag also reads ``OUTRIDER_<NAME>`` (read when the parser is built); a flag
on the command line wins.

A field's ``metadata`` may refine its flag: ``parse`` (a function from the
text to the value, raising ValueError with a message), ``choices``,
``metavar``, ``flag=False`` to leave it out of the command line,
``positional=True`` for a text given without a flag, and ``env`` to say
whether it reads its variable (default: :func:`add_flags`'s ``env``). A
tuple-valued field may be ``repeatable`` (``--flag A --flag B``) or a
positional argument (``nargs``: ``"+"``, ``"*"`` or ``argparse.REMAINDER``);
each of its items is then parsed alone, and it reads no variable. With
``late=True`` the text stays text until :func:`build` parses it, so that
its ValueError reaches the command as a config check's does, instead of
being a usage error. A ``bool | None`` field (None: leave the choice to
someone else) is ``--name`` / ``--no-name``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import os
import textwrap
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

ENV_PREFIX = "OUTRIDER_"
Config = TypeVar("Config")


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass: the string literal right
    under each annotated field, whitespace folded."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0]
        assert isinstance(body, ast.ClassDef)
        for node, after in zip(body.body, body.body[1:], strict=False):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off", ""}:
        return False
    raise ValueError(f"{text!r} is not a boolean: use true or false")


def parse_list(text: str) -> tuple[str, ...]:
    """A comma-separated list."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


@dataclasses.dataclass(frozen=True)
class _Flag:
    field: dataclasses.Field
    doc: str
    kind: Any
    """The field's type without ``None``."""
    default: Any

    @property
    def name(self) -> str:
        return self.field.name

    @property
    def is_bool(self) -> bool:
        return self.kind is bool

    @property
    def is_list(self) -> bool:
        """Given item by item: repeated, or as positional arguments."""
        return bool(self.field.metadata.get("repeatable")) or "nargs" in self.field.metadata

    def parser(self) -> Callable[[str], Any]:
        parse = self.field.metadata.get("parse")
        if parse is not None:
            return parse
        if self.is_bool:
            return parse_bool
        kind = typing.get_args(self.kind)[0] if self.is_list else self.kind
        if typing.get_origin(kind) is tuple:
            return parse_list
        if kind in (int, float, str, Path):
            return kind
        raise TypeError(f"no flag parser for {self.name}: {self.kind}")

    def argparse_parser(self) -> Callable[[str], Any]:
        """What argparse applies to the text: :meth:`parser`, or nothing when
        :func:`build` parses it (``late``)."""
        return str if self.field.metadata.get("late") else self.parser()


def _flags(cls: type, overrides: dict[str, Any] | None = None) -> list[_Flag]:
    """The flags of ``cls``, nested configs flattened, with their defaults
    (a nested config's default instance gives its fields' defaults)."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    flags: list[_Flag] = []
    for field in dataclasses.fields(cls):
        if not field.metadata.get("flag", True):
            continue
        kind = _without_none(hints[field.name])
        default = _default(field)
        if overrides and field.name in overrides:
            default = overrides[field.name]
        if dataclasses.is_dataclass(kind) and isinstance(kind, type):
            nested = {f.name: getattr(default, f.name) for f in dataclasses.fields(kind)}
            flags.extend(_flags(kind, nested))
        else:
            flags.append(_Flag(field, docs.get(field.name, ""), kind, default))
    return flags


def _without_none(hint: Any) -> Any:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _shown(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(map(str, value)) or "none"
    return str(value)


def add_flags(parser: argparse.ArgumentParser, cls: type, *, env: bool = True) -> None:
    """Adds a flag for every field of ``cls`` (see the module docstring);
    with ``env=False`` only fields whose metadata says ``env=True`` read a
    variable. A bad ``OUTRIDER_*`` value is a usage error naming the variable."""
    for flag in _flags(cls):
        if flag.field.metadata.get("positional"):
            parser.add_argument(flag.name, help=flag.doc.replace("%", "%%"))
            continue
        reads_env = flag.field.metadata.get("env", env) and not flag.is_list
        variable = env_name(flag.name) if reads_env else None
        default = flag.default
        if variable is not None and variable in os.environ:
            raw = os.environ[variable]
            try:
                default = flag.argparse_parser()(raw)
            except (ValueError, argparse.ArgumentTypeError) as exc:
                parser.error(f"{variable}={raw!r} is not a valid {flag_name(flag.name)}: {exc}")
        positional = "nargs" in flag.field.metadata
        shown = (
            ""
            if flag.default is None or flag.is_bool or positional
            else f" (default: {_shown(flag.default)})"
        )
        named = f" [env {variable}]" if variable else ""
        help_text = f"{flag.doc}{shown}{named}".replace("%", "%%")
        options: dict[str, Any] = dict(dest=flag.name, default=default, help=help_text)
        if flag.is_bool:
            action = argparse.BooleanOptionalAction if flag.default is None else "store_true"
            parser.add_argument(flag_name(flag.name), action=action, **options)
            continue
        for key in ("choices", "metavar"):
            if key in flag.field.metadata:
                options[key] = flag.field.metadata[key]
        if "choices" not in options and "metavar" not in options:
            options["metavar"] = _metavar(flag)
        options["type"] = _argparse_type(flag.argparse_parser())
        if positional:  # its name is its dest
            del options["dest"]
            parser.add_argument(flag.name, nargs=flag.field.metadata["nargs"], **options)
            continue
        if flag.is_list:
            options["action"] = _Repeated
        parser.add_argument(flag_name(flag.name), **options)


class _Repeated(argparse.Action):
    """A ``repeatable`` field: each use of the flag adds one item, the first
    in place of the default (argparse's ``append`` would add to it)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        given = getattr(namespace, self.dest)
        items = () if given is self.default else tuple(given)
        setattr(namespace, self.dest, (*items, values))


def _metavar(flag: _Flag) -> str:
    if flag.kind is Path:
        return "FILE"
    if flag.kind is int:
        return "N"
    if flag.kind is float:
        return "SECONDS" if flag.name.endswith("_s") else "X"
    return flag.name.rpartition("_")[2].upper()


def _argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` with its ValueError message shown by argparse as it is."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def build(cls: type[Config], args: argparse.Namespace, **values: Any) -> Config:
    """An instance of ``cls`` from parsed flags (nested configs built the same
    way); ``values`` set fields that are not flags, or override them."""
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        kind = _without_none(hints[field.name])
        if field.name in values:
            kwargs[field.name] = values[field.name]
        elif dataclasses.is_dataclass(kind) and isinstance(kind, type):
            kwargs[field.name] = build(kind, args)
        elif field.metadata.get("flag", True) and hasattr(args, field.name):
            value = getattr(args, field.name)
            if isinstance(value, list | tuple):  # repeated, or positional
                value = tuple(_late(field, item) for item in value)
            kwargs[field.name] = _late(field, value)
    return cls(**kwargs)


def _late(field: dataclasses.Field, value: Any) -> Any:
    """A ``late`` flag's text parsed; any other value as it is."""
    if field.metadata.get("late") and isinstance(value, str):
        return field.metadata["parse"](value)
    return value


def flag_defaults(cls: type) -> dict[str, Any]:
    """Each flag's default, as :func:`add_flags` sets it without variables."""
    return {flag.name: flag.default for flag in _flags(cls)}
