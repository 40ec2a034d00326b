"""Option plumbing shared by nsqd and nsqlookupd: Go-style durations, sizes, and flags over a TOML config.

Each side declares its options once (an attrs class whose fields carry the flag's help text); the
command line is generated from that, and a `--config` TOML file with the same keys (nsqd's names,
underscored) fills in whatever the command line did not set.
"""

from __future__ import annotations

import argparse
import re
import tomllib
from typing import Any

import attrs

_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(ns|us|µs|ms|s|m|h)")
_PLAIN_NUMBER = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+", re.ASCII)
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: str | int | float) -> float:
    """Go's time.ParseDuration ("1m30s", "250ms"), or plain seconds; returns seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    text = str(value).strip()
    if _PLAIN_NUMBER.fullmatch(text):
        return float(text)  # our leniency: plain seconds
    sign = -1.0 if text.startswith("-") else 1.0
    if text[:1] in "+-":
        text = text[1:]
    pos, total = 0, 0.0
    while pos < len(text):
        match = _DURATION_PART.match(text, pos)
        if not match:
            raise ValueError(f"invalid duration {value!r}")
        total += float(match.group(1)) * _UNITS[match.group(2)]
        pos = match.end()
    if pos == 0:
        raise ValueError(f"invalid duration {value!r}")
    return sign * total


def format_duration(seconds: float) -> str:
    if seconds and seconds < 1:
        return f"{round(seconds * 1000)}ms"
    return f"{seconds:g}s"


def option(
    default: Any, help: str, *, kind: str = "", flag: str = "", cfg: str = "", repeat: bool = False
) -> Any:
    """An option field: `kind` is "duration" for Go durations; `flag`/`cfg` name the flag and TOML key
    where Go's differ from the field name; `repeat` for flags given several times."""
    metadata = {"help": help, "kind": kind, "flag": flag, "cfg": cfg, "repeat": repeat}
    if isinstance(default, list):
        return attrs.field(factory=lambda: list(default), metadata=metadata)
    return attrs.field(default=default, metadata=metadata)


def _flag_name(field: attrs.Attribute) -> str:
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def _converter(field: attrs.Attribute):
    if field.metadata.get("kind") == "duration":
        return parse_duration
    if field.metadata.get("kind") == "float":
        return float
    if field.metadata.get("kind") == "floats":
        return _floats
    default = field.default
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        return str
    if isinstance(default, bool):
        return _parse_bool
    if isinstance(default, int):
        return int
    if isinstance(default, float):
        return float
    return str


def _floats(value: Any) -> list[float]:
    """One flag value holding one or more comma-separated numbers (Go's app.FloatArray)."""
    if isinstance(value, (int, float)):
        return [float(value)]
    return [float(part) for part in str(value).split(",") if part.strip()]


def _flatten(values: list) -> list:
    out = []
    for value in values:
        out.extend(value if isinstance(value, list) else [value])
    return out


def _parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"invalid boolean {value!r}")


def build_parser(cls: type, prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", help="path to a TOML config file (same keys as the flags, underscored)")
    parser.add_argument("--version", action="store_true", help="print version string and exit")
    for field in attrs.fields(cls):
        convert = _converter(field)
        kwargs: dict[str, Any] = {"dest": field.name, "default": argparse.SUPPRESS, "help": field.metadata["help"].replace("%", "%%")}
        if field.metadata.get("repeat"):
            kwargs["action"] = "append"
        elif isinstance(field.default, bool):
            kwargs["nargs"] = "?"
            kwargs["const"] = True
        kwargs["type"] = convert
        parser.add_argument(_flag_name(field), **kwargs)
    return parser


def load_options(cls: type, argv: list[str] | None, prog: str, description: str) -> Any:
    """Flags win over the config file, which wins over the defaults."""
    parser = build_parser(cls, prog, description)
    args = vars(parser.parse_args(argv))
    if args.pop("version", False):
        from shared.version import VERSION

        print(f"{prog} v{VERSION}")  # the one print: a CLI answering --version
        raise SystemExit(0)
    values: dict[str, Any] = {}
    config_path = args.pop("config", None)
    if config_path:
        with open(config_path, "rb") as fh:
            values.update(config_values(cls, tomllib.load(fh), parser))
    values.update(args)
    for field in attrs.fields(cls):
        if field.metadata.get("kind") == "floats" and field.name in values:
            # as nsqd: every value given, in descending order
            values[field.name] = sorted(_flatten(values[field.name]), reverse=True)
    return cls(**values)


def config_values(cls: type, raw: dict[str, Any], parser: argparse.ArgumentParser) -> dict[str, Any]:
    fields = {f.metadata.get("cfg") or f.name: f for f in attrs.fields(cls)}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        field = fields.get(key.replace("-", "_"))
        if field is None:
            continue  # as Go's go-options: keys of no option are ignored
        convert = _converter(field)
        if field.metadata.get("kind") == "duration" and isinstance(value, int) and not isinstance(value, bool):
            value = value / 1000  # go-options reads an integer duration in the config as milliseconds
        try:
            if field.metadata.get("repeat"):
                values[field.name] = [convert(v) for v in (value if isinstance(value, list) else [value])]
            else:
                values[field.name] = convert(value)
        except ValueError as exc:
            parser.error(f"config key {key!r}: {exc}")
    return values
