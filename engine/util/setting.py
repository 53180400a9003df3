"""Settings declared once: a dataclass field that carries its own command-line option.

`setting(default, "--flag", help=..., group=...)` is a `dataclasses.field` whose metadata holds
the option; `add_options(parser, cls)` adds every such field of `cls` to an argparse parser
(dest = the field's name, default = the field's default, grouped by `group`), and
`option_values(cls, args)` reads them back as keyword arguments for `cls`. So a new flag is one
edit: the field. Invariant: an option's default is its field's default, never a second copy.

Imported whenever the `kvmesh` parser is built: nothing heavy at module level.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

_KEY = "kvmesh.option"


@dataclass(frozen=True)
class Option:
    flag: str
    help: str
    group: str
    kwargs: dict[str, Any]


def setting(default: Any, flag: str, *, help: str, group: str, **kwargs: Any) -> Any:
    """A dataclass field with ``default`` and the option ``flag`` (further ``kwargs`` go to
    ``add_argument``: type, choices, metavar, action). ``action="store_false"`` makes a
    "--no-x" flag for a field that defaults to True. "%(default)s" in ``help`` works."""
    return dataclasses.field(default=default, metadata={_KEY: Option(flag, help, group, kwargs)})


def options(cls: type) -> list[tuple[dataclasses.Field, Option]]:
    return [(f, f.metadata[_KEY]) for f in dataclasses.fields(cls) if _KEY in f.metadata]


def add_options(parser: argparse.ArgumentParser, cls: type,
                groups: dict[str, argparse._ArgumentGroup] | None = None) -> dict[str, argparse._ArgumentGroup]:
    """Add ``cls``'s options to ``parser`` in field order; returns the groups by title (pass
    them again to put another class's options into the same groups)."""
    groups = {} if groups is None else groups
    for f, opt in options(cls):
        group = groups.get(opt.group)
        if group is None:
            group = groups[opt.group] = parser.add_argument_group(opt.group)
        group.add_argument(opt.flag, dest=f.name, default=f.default, help=opt.help, **opt.kwargs)
    return groups


def option_values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """``{field name: parsed value}`` for every option of ``cls``."""
    return {f.name: getattr(args, f.name) for f, _ in options(cls)}
