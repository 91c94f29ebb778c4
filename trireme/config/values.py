"""Typed configuration, part 3: values from TOML and `--section.key=value` checked against the
fields' types, and the presets."""

from __future__ import annotations

import difflib
import functools
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from trireme.config.model import PRESET_DIR, ResumeStep
from trireme.config.sections import _SECTION_TYPES, Config
from trireme.errors import ConfigError

# --------------------------------------------------------------------------------------------
# Coercion and type checking of values


def _to_resume_step(key: str, value: Any) -> str:
    if isinstance(value, str) and value in ResumeStep.WORDS:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        step = -1
    else:
        try:
            step = int(value)
        except ValueError:
            step = -1
    if step < 0:
        raise ConfigError(f"{key} = {value!r} must be latest, latest-intact or a step number "
                          "(an integer, at least 0)")
    return str(step)


def _type_name(tp: Any) -> str:
    if tp is ResumeStep:
        return "latest | latest-intact | int"
    if get_origin(tp) is Literal:
        return " | ".join(str(a) for a in get_args(tp))
    if get_origin(tp) is list:
        return f"list of {_type_name(get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check (and for strings from the command line, parse) one value against its field type."""
    origin = get_origin(tp)
    if origin is Literal:
        choices = get_args(tp)
        if isinstance(value, bool):  # TOML true/false for a "true"/"false" literal
            value = str(value).lower()
        if value not in choices:
            raise ConfigError(f"{key} = {value!r} is not one of: {', '.join(map(str, choices))}")
        return value
    if origin is list:
        (item,) = get_args(tp)
        if isinstance(value, str):
            value = _split_list(key, value)
        if not isinstance(value, list):
            raise ConfigError(f"{key} = {value!r}: expected a list of {_type_name(item)}")
        return [_coerce(key, v, item) for v in value]
    if origin in (types.UnionType, typing.Union):
        raise TypeError("config fields must not be unions")  # a design rule, not a user error
    scalar = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str,
              ResumeStep: _to_resume_step}.get(tp)
    if scalar is not None:
        return scalar(key, value)
    raise TypeError(f"unsupported config field type {tp!r} for {key}")


def _to_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
        return True
    if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
        return False
    raise ConfigError(f"{key} = {value!r}: expected true or false")


def _to_int(key: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{key} = {value!r}: expected an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.replace("_", ""))
        except ValueError:
            try:
                f = float(value)
            except ValueError:
                f = math.nan
            if f.is_integer():
                return int(f)
    raise ConfigError(f"{key} = {value!r}: expected an integer")


def _to_float(key: str, value: Any) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{key} = {value!r}: expected a number")
    number = None
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            pass
    if number is None:
        raise ConfigError(f"{key} = {value!r}: expected a number")
    if not math.isfinite(number):  # nan, inf, or a literal too large for a float (1e400)
        raise ConfigError(f"{key} = {value!r}: expected a finite number")
    return number


def _to_str(key: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    raise ConfigError(f"{key} = {value!r}: expected a string")


def _split_list(key: str, text: str) -> list[str]:
    """A list from the command line: `[a, b]`, `a,b` or `'a'`; brackets must pair up."""
    body = text.strip()
    if body.startswith("[") != body.endswith("]"):
        raise ConfigError(f"{key} = {text!r}: unbalanced brackets; write a list as [a, b]")
    items = [v.strip() for v in body.removeprefix("[").removesuffix("]").split(",")]
    return [v.strip("'\"") for v in items if v]


def _suggest(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


@functools.cache  # the hints of a section never change; validate asks for all of them
def _field_types(section: str) -> dict[str, Any]:
    return typing.get_type_hints(_SECTION_TYPES[section])


def set_value(cfg: Config, dotted_key: str, value: Any) -> None:
    """Set `section.key` to `value`, checking that the key exists and the type fits."""
    if "." not in dotted_key:
        raise ConfigError(
            f"config key {dotted_key!r} must be written section.key, e.g. train.steps"
        )
    section, key = dotted_key.split(".", 1)
    if section not in _SECTION_TYPES:
        raise ConfigError(
            f"unknown config section {section!r}{_suggest(section, list(_SECTION_TYPES))}; "
            f"sections: {', '.join(_SECTION_TYPES)}"
        )
    types_ = _field_types(section)
    if key not in types_:
        elsewhere = [f"{s}.{key}" for s in _SECTION_TYPES if key in _field_types(s)]
        all_keys = [f"{section}.{k}" for k in types_] + [
            f"{s}.{k}" for s in _SECTION_TYPES for k in _field_types(s)
        ]
        hint = (f" (did you mean {elsewhere[0]!r}?)" if elsewhere
                else _suggest(dotted_key, all_keys))  # the same key in another section first
        raise ConfigError(f"unknown config key {dotted_key!r}{hint}")
    setattr(getattr(cfg, section), key, _coerce(dotted_key, value, types_[key]))


def check_types(cfg: Config) -> None:
    """Check every field against its type as `set_value` does, for values set in code (a notebook's
    `cfg.train.steps = 2.5`, `dataclasses.replace`): a ConfigError naming the key, instead of a
    traceback or a value silently taken. A string for a number is parsed as on the command line."""
    for section, cls in _SECTION_TYPES.items():
        part = getattr(cfg, section)
        if not isinstance(part, cls):
            raise ConfigError(f"config section {section} = {part!r}: expected a {cls.__name__}")
        for name, tp in _field_types(section).items():
            setattr(part, name, _coerce(f"{section}.{name}", getattr(part, name), tp))


def apply_dict(cfg: Config, data: dict[str, Any], source: str) -> None:
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(
                f"{source}: top-level key {section!r} must be a [section] table, "
                f"e.g. [{section if section in _SECTION_TYPES else 'train'}]"
            )
        for key, value in values.items():
            set_value(cfg, f"{section}.{key}", value)


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def resolve_preset(name_or_path: str) -> Path:
    if not name_or_path.strip():  # Path("") is the working directory
        raise ConfigError("--config is empty: give a preset name or a .toml path")
    p = Path(name_or_path)
    if p.is_dir() and (p / "config.toml").is_file():  # a checkpoint's step directory
        return p / "config.toml"
    if p.is_dir():
        raise ConfigError(f"--config {name_or_path!r} is a directory: give a preset name or a "
                          ".toml file (a checkpoint's config is its step_*/config.toml)")
    if p.suffix == ".toml" or p.exists():
        if not p.is_file():
            raise ConfigError(f"config file {name_or_path!r} does not exist")
        return p
    preset = PRESET_DIR / f"{name_or_path}.toml"
    if not preset.is_file():
        names = preset_names()
        raise ConfigError(
            f"unknown preset {name_or_path!r}{_suggest(name_or_path, names)}; "
            f"presets: {', '.join(names)}, or give a path to a .toml file"
        )
    return preset
