"""Typed YAML configuration: dataclass schemas, dotted overrides, readable errors.

Every config in the project is a (possibly nested) ``@dataclass`` whose fields are
declared with :func:`option`, which carries a help text. :func:`load_config` reads a
YAML file, applies ``a.b.c=value`` overrides from the command line, and validates
everything against the schema *before* any model is loaded. Mistakes are reported
as :class:`ConfigError` naming the full dotted field, e.g.::

    config error: trainer.kl.topk: expected int, got 'abc'
    config error: unknown key 'trainer.klx' (did you mean 'trainer.kl'?)

A dataclass may define ``validate(self)`` to check cross-field constraints; it is
called after construction and should raise ``ConfigError``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration problem, with the dotted path of the offending field."""


@dataclass(frozen=True)
class Bounds:
    """The range of a number option (of each number of a list option), checked by :func:`from_dict`.

    ``ge``/``gt``/``le``/``lt``: inclusive / exclusive lower and upper bounds (None: none). A float is
    finite unless ``inf`` says what infinity means for the option (then ``inf`` is allowed where
    the bounds allow it); NaN is never a setting.
    """

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    inf: str | None = None

    def describe(self) -> str:
        """``> 0``, ``[0, 1]``, ``[0, 1)``, ``>= 1``, ... ('' when unbounded)."""
        low = (f"[{_num(self.ge)}" if self.ge is not None else f"({_num(self.gt)}" if self.gt is not None else None)
        high = (f"{_num(self.le)}]" if self.le is not None else f"{_num(self.lt)})" if self.lt is not None else None)
        if low and high:
            return f"{low}, {high}"
        if low:
            return f"{'>=' if self.ge is not None else '>'} {low[1:]}"
        if high:
            return f"{'<=' if self.le is not None else '<'} {high[:-1]}"
        return ""

    def allows(self, value: int | float) -> bool:
        if isinstance(value, float) and (math.isnan(value) or (math.isinf(value) and self.inf is None)):
            return False
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def expectation(self, integer: bool) -> str:
        """What a valid setting is, for an error message: ``a finite number > 0``, ``an integer in [0, 64]``."""
        what = "an integer" if integer else "a number" if self.inf is not None else "a finite number"
        rng = self.describe()
        rng = f" in {rng}" if rng.startswith(("[", "(")) else f" {rng}" if rng else ""
        return what + rng + (f" (inf: {self.inf})" if self.inf is not None and not integer else "")


def _num(x: float) -> str:
    return f"{x:g}"


def option(default: Any = dataclasses.MISSING, help: str = "", *, default_factory: Any = dataclasses.MISSING,
           ge: float | None = None, gt: float | None = None, le: float | None = None, lt: float | None = None,
           inf: str | None = None) -> Any:
    """Declare a config field with a help text (shown in ``--help`` and the README reference).

    For a number (or list of numbers) field, ``ge``/``gt``/``le``/``lt`` declare its range and ``inf``
    what infinity means, when the option accepts it (a float is otherwise finite): see :class:`Bounds`.
    The range is checked once, for every schema, when a config is built (:func:`from_dict`), and shown
    in ``--help`` and the reference.
    """
    if not help:
        raise TypeError("every config option needs a help text")
    kwargs: dict[str, Any] = {"metadata": {"help": help, "bounds": Bounds(ge, gt, le, lt, inf)}}
    if default_factory is not dataclasses.MISSING:
        kwargs["default_factory"] = default_factory
    elif isinstance(default, (list, dict, set)):
        kwargs["default_factory"] = lambda d=default: type(d)(d)
    else:
        kwargs["default"] = default
    return dataclasses.field(**kwargs)


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


_YAML_BOOL_WORDS = {True: ("on", "yes", "true", "y"), False: ("off", "no", "false", "n")}


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and convert the harmless cases."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{where}: expected {' or '.join(_type_name(a) for a in args)}, got {value!r}")
    if origin is Literal:
        choices = get_args(tp)
        if isinstance(value, bool) and value not in choices:
            # YAML 1.1 reads on/off/yes/no as booleans: give back the spelling the field accepts.
            spelled = [c for c in choices if isinstance(c, str) and c.lower() in _YAML_BOOL_WORDS[value]]
            value = spelled[0] if len(spelled) == 1 else value
        if value not in choices:
            hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            extra = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(repr(c) for c in choices)}{extra}")
        return value
    if origin in (list, tuple):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (item_tp, *_) = get_args(tp) or (Any,)
        return [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        _, val_tp = get_args(tp) or (str, Any)
        return {str(k): _coerce(v, val_tp, f"{where}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return from_dict(tp, value, where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{where}: expected int, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads "1e-6" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}")
    return value


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_dict(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Build dataclass ``cls`` from a plain mapping, rejecting unknown keys and bad types."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {data!r}")
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in names:
            where = f"{prefix}.{key}" if prefix else key
            hint = difflib.get_close_matches(str(key), sorted(names), n=1)
            extra = f" (did you mean '{prefix + '.' if prefix else ''}{hint[0]}'?)" if hint else ""
            raise ConfigError(f"unknown key '{where}'{extra}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            where = f"{prefix}.{f.name}" if prefix else f.name
            kwargs[f.name] = _coerce(data[f.name], hints[f.name], where)
            _check_range(kwargs[f.name], bounds_of(f), where)
    try:
        obj = cls(**kwargs)
    except TypeError as e:  # a required field without default
        raise ConfigError(f"{prefix or cls.__name__}: {e}") from None
    validate = getattr(obj, "validate", None)
    if callable(validate):
        try:
            validate()
        except ConfigError as e:
            raise ConfigError(f"{prefix + ': ' if prefix else ''}{e}") from None
    return obj


def bounds_of(f: dataclasses.Field) -> Bounds:
    """The declared range of a config field (unbounded when it declares none)."""
    return f.metadata.get("bounds") or Bounds()


def _check_range(value: Any, bounds: Bounds, where: str) -> None:
    """The one range check of every number option (and of each number of a list option): NaN never
    passes, infinity only where the option says what it means, then the declared bounds."""
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_range(v, bounds, f"{where}[{i}]")
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and not bounds.allows(value):
        raise ConfigError(f"{where}: expected {bounds.expectation(isinstance(value, int))}, got {value!r}")


def to_dict(obj: Any) -> Any:
    """Plain-data view of a config (for YAML dumps, logs and checkpoints)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    return obj


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"a.b=3"`` -> (["a", "b"], 3). The value is parsed as YAML (so ``true``, ``1e-6``, ``[1,2]`` work)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.subkey=value")
    key, raw = text.split("=", 1)
    key = key.strip().lstrip("-")
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    except RecursionError:  # PyYAML composes recursively
        raise ConfigError(f"override {key!r}: the value is nested too deeply") from None
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each dotted key in a nested mapping (creating intermediate mappings)."""
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: '{part}' is not a section")
            node = child
        node[path[-1]] = value
    return data


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    except RecursionError:  # PyYAML composes recursively
        raise ConfigError(f"{p}: not a config: nested too deeply") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping")
    return data


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """YAML file (optional) + dotted overrides -> validated ``cls`` instance."""
    data = read_yaml(path) if path else {}
    apply_overrides(data, list(overrides or []))
    return from_dict(cls, data)


def dump_yaml(obj: Any, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(obj), sort_keys=False))


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """Rows (dotted key, type, default, help) for every leaf option of a config schema."""
    rows = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(describe(tp, key + "."))
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        else:
            default = "(required)"
        note, (inner, nullable) = _range_note(bounds_of(f)), _argparse_kind(tp)
        if note and get_origin(inner) in (list, tuple):
            note = f" (each{note})"
        type_text = f"{_type_name(inner)}{note} | None" if note and nullable else _type_name(tp) + note
        rows.append((key, type_text, repr(default), f.metadata.get("help", "")))
    return rows


def _range_note(bounds: Bounds) -> str:
    """`` > 0``, `` in [0, 1]``, `` (inf: no limit)``: the declared range after a type name ('' when none)."""
    rng = bounds.describe()
    note = (f" in {rng}" if rng.startswith(("[", "(")) else f" {rng}") if rng else ""
    return note + (f" (inf: {bounds.inf})" if bounds.inf else "")


def markdown_reference(cls: type, title: str) -> str:
    """A markdown table of every option, generated from the help texts."""
    lines = [f"#### {title}", "", "| key | type | default | meaning |", "|---|---|---|---|"]
    for key, tp, default, help_ in describe(cls):
        escaped = help_.replace("|", "\\|")
        lines.append(f"| `{key}` | {tp} | `{default}` | {escaped} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------- argparse


def _flag(dotted: str) -> str:
    return "--" + dotted.replace("_", "-").replace(".", "-")


def _argparse_kind(tp: Any) -> tuple[Any, bool]:
    """(the non-None annotation, whether None is allowed)."""
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], type(None) in get_args(tp)
    return tp, False


def add_config_arguments(parser: Any, cls: type, *, exclude: tuple[str, ...] = (), prefix: str = "",
                         positional: tuple[str, ...] = (), flags: dict[str, str] | None = None,
                         hide_defaults: tuple[str, ...] = ()) -> None:
    """Add one command-line option per leaf field of config dataclass ``cls`` to an argparse parser.

    The help text is the field's ``option(help=...)`` (plus its default), so a command's ``--help`` and
    the README reference are generated from the same words. Field ``a.b_c`` becomes ``--a-b-c``, or the
    flag ``flags`` gives for ``"a.b_c"`` (a command's established spelling); booleans get
    ``--x/--no-x``; ``Literal`` fields list their choices; ``X | None`` fields take an X; list fields
    take several values (the flag may also repeat); ``dict[str, str]`` fields take ``KEY=VALUE``
    (repeatable). Names in ``positional`` become positional arguments (a required list takes one or
    more). Keys starting with a prefix in ``hide_defaults`` do not print the dataclass default (when a
    command takes its defaults from elsewhere, e.g. a preset). Unset options are left out of the namespace (defaults come from the dataclass), so
    :func:`config_from_args` validates exactly what the user gave.
    """
    import argparse

    flags = flags or {}
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        dotted = f"{prefix}{f.name}"
        if dotted in exclude or not f.init:
            continue
        tp, nullable = _argparse_kind(hints[f.name])
        if dataclasses.is_dataclass(tp):
            add_config_arguments(parser, tp, exclude=exclude, prefix=dotted + ".", positional=positional, flags=flags,
                                 hide_defaults=hide_defaults)
            continue
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING  # type: ignore[misc]
        help_ = f.metadata.get("help", "")
        notes = [_range_note(bounds_of(f)).strip().removeprefix("in ")] if _range_note(bounds_of(f)) else []
        if not required and not dotted.startswith(hide_defaults or ("\0",)):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            notes += [f"default: {default!r}"] if default not in (None, "", [], {}) else []
        help_ += f" ({'; '.join(notes)})" if notes else ""
        kwargs: dict[str, Any] = {"help": help_.replace("%", "%%"), "dest": dotted, "default": argparse.SUPPRESS,
                                  "metavar": f.name.upper()}
        origin = get_origin(tp)
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
            kwargs.pop("metavar")
        elif origin is Literal:
            kwargs.pop("metavar")
            choices = list(get_args(tp))
            kwargs["choices"] = choices
            kwargs["type"] = type(choices[0]) if len({type(c) for c in choices}) == 1 else str
        elif origin in (list, tuple):
            (item_tp, *_) = get_args(tp) or (str,)
            kwargs["nargs"] = "+" if required and f.name in positional else "*"
            kwargs["action"] = "extend"
            if get_origin(item_tp) is Literal:
                kwargs["choices"] = list(get_args(item_tp))
                kwargs.pop("metavar")
            kwargs["type"] = item_tp if item_tp in (int, float, str) else str
        elif origin is dict:
            kwargs["action"] = "append"
            kwargs["metavar"] = "KEY=VALUE"
            kwargs["type"] = str
        elif tp in (int, float, str):
            kwargs["type"] = tp
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: no command-line form for {_type_name(tp)}")
        if nullable and kwargs.get("type") in (int, float):
            base = kwargs["type"]
            kwargs["type"] = lambda s, base=base: None if s.lower() in ("none", "null") else base(s)
        if f.name in positional:
            kwargs.pop("dest")
            kwargs.pop("metavar", None)
            kwargs.pop("action", None)  # a positional list is one run of values, not a repeatable flag
            if required:
                kwargs.pop("default")
            elif "nargs" not in kwargs:
                kwargs["nargs"] = "?"
            parser.add_argument(dotted, **kwargs)
            continue
        kwargs["required"] = required
        if kwargs.get("action") is argparse.BooleanOptionalAction:
            kwargs.pop("required")
        parser.add_argument(flags.get(dotted, _flag(dotted)), **kwargs)


def config_from_args(cls: type[T], args: Any, *, extra: dict[str, Any] | None = None) -> T:
    """The validated ``cls`` from a namespace filled by :func:`add_config_arguments` (plus ``extra`` values)."""
    data: dict[str, Any] = {}
    hints = _leaf_hints(cls)
    for key, value in {**vars(args), **(extra or {})}.items():
        if get_origin(_argparse_kind(hints.get(key))[0]) is dict and isinstance(value, list):
            value = _key_values(key, value)
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    names = {f.name for f in dataclasses.fields(cls)}
    try:
        return from_dict(cls, {k: v for k, v in data.items() if k in names})
    except ConfigError as e:  # name a command-line option by its flag, as the user typed it
        key, sep, rest = str(e).partition(": ")
        if sep and rest.startswith("expected ") and key.split("[")[0] in vars(args):
            raise ConfigError(f"{_flag(key.split('[')[0])}{key[len(key.split('[')[0]):]}: {rest}") from None
        raise


def _leaf_hints(cls: type, prefix: str = "") -> dict[str, Any]:
    """Dotted leaf key -> annotation, for every field of a config schema."""
    out: dict[str, Any] = {}
    for name, tp in _hints(cls).items():
        inner = _argparse_kind(tp)[0]
        if dataclasses.is_dataclass(inner):
            out.update(_leaf_hints(inner, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = tp
    return out


def _key_values(key: str, items: list[str]) -> dict[str, str]:
    """``["a=1", "b=2"]`` -> ``{"a": "1", "b": "2"}``; anything else is a ConfigError naming ``key``."""
    out = {}
    for item in items:
        name, sep, value = str(item).partition("=")
        if not sep or not name or not value:
            raise ConfigError(f"{key}: expected KEY=VALUE, got {item!r}")
        out[name] = value
    return out


def markdown_command_reference(parser: Any) -> str:
    """A markdown table of a command's options, read off its argparse ``parser`` (built by
    :func:`add_config_arguments`), titled with its ``prog``: the README shows exactly what ``--help``
    shows. Sub-commands get their own tables."""
    import argparse

    lines = [f"#### `{parser.prog}` options", "", "| option | meaning |", "|---|---|"]
    subcommands: list[tuple[str, Any]] = []
    for action in parser._actions:  # argparse has no public accessor for the actions
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            subcommands += list(action.choices.items())
            continue
        if action.option_strings:
            name = ", ".join(f"`{o}`" for o in action.option_strings)
            if action.nargs != 0:
                name += f" `{action.metavar or action.dest.upper()}`" if not action.choices else ""
        else:
            name = f"`{action.metavar or action.dest.upper()}`" + ("…" if action.nargs in ("*", "+") else "")
        meaning = (action.help or "").replace("%%", "%")
        if action.choices:
            meaning += f"; one of: {', '.join(map(str, action.choices))}"
        if action.required:
            meaning += " (required)"
        lines.append(f"| {name} | {meaning.replace('|', chr(92) + '|')} |")
    out = "\n".join(lines) + "\n" if len(lines) > 4 else ""
    return "\n".join([out, *(markdown_command_reference(sub_parser) for _, sub_parser in subcommands)]).strip("\n") + "\n"
