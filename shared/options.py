"""Option plumbing shared by nsqd and nsqlookupd: Go-style durations, sizes, and flags over a TOML config.

Each side declares its options once (an attrs class whose fields carry the flag's help text); the
command line is generated from that, and a `--config` TOML file with the same keys (nsqd's names,
underscored) fills in whatever the command line did not set.
"""

from __future__ import annotations

import json
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
    """Go's time.Duration.String(): "1h0m0s", "1m30s", "2s", "250ms", "1.5µs"."""
    return format_duration_ns(round(seconds * 1e9))


def format_duration_ns(ns: int) -> str:
    """format_duration of a whole number of nanoseconds (Go's Duration itself), exact at any size."""
    sign, ns = ("-" if ns < 0 else ""), abs(ns)

    def fraction(value: int, scale: int) -> str:
        whole, rest = divmod(value, scale)
        digits = str(rest).rjust(len(str(scale)) - 1, "0").rstrip("0") if rest else ""
        return f"{whole}.{digits}" if digits else str(whole)

    if ns == 0:
        return "0s"
    if ns < 10**9:
        for unit, scale in (("ms", 10**6), ("µs", 10**3), ("ns", 1)):
            if ns >= scale:
                return sign + fraction(ns, scale) + unit
    hours, rest = divmod(ns, 3600 * 10**9)
    minutes, rest = divmod(rest, 60 * 10**9)
    text = fraction(rest, 10**9) + "s"
    if hours or minutes:
        text = f"{minutes}m{text}"
    if hours:
        text = f"{hours}h{text}"
    return sign + text


def _go_quote(value: object) -> str:
    """Go's %q for the flag messages and usage defaults."""
    return json.dumps(str(value), ensure_ascii=False)


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
    if field.metadata.get("kind") == "tls_required":
        return parse_tls_required
    if field.metadata.get("kind") == "log_level":
        return _log_level
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


_TRUE = ("1", "t", "T", "TRUE", "true", "True")
_FALSE = ("0", "f", "F", "FALSE", "false", "False")


def _parse_bool(value: Any) -> bool:
    """Go's strconv.ParseBool (a flag's and the config's booleans)."""
    if isinstance(value, bool):
        return value
    text = str(value)
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"invalid boolean {value!r}")


def parse_tls_required(value: Any) -> str:
    """nsqd's --tls-required: a boolean, or `tcp-https` (TLS for TCP clients, plain HTTP allowed)."""
    text = str(value).lower()
    if text == "tcp-https":
        return text
    return "true" if _parse_bool(value if isinstance(value, bool) else text) else "false"


def _log_level(value: Any) -> str:
    from trio_nsq.shared.logs import parse_level

    parse_level(str(value))  # raises ValueError for a level nsqd does not know
    return str(value)


class FlagError(Exception):
    """A command line Go's flag package would refuse; the message is Go's."""


def _is_bool_flag(field: attrs.Attribute | None) -> bool:
    # Go's IsBoolFlag: `-flag` alone means true, and the next argument is never its value
    return field is None or isinstance(field.default, bool) or field.metadata.get("kind") == "tls_required"


def parse_flags(
    cls: type, argv: list[str], deprecated: dict[str, str] | None = None
) -> tuple[dict[str, Any], list[str]]:
    """Go's flag package over the option fields of `cls`: `-flag=value`, `-flag value`, `--flag=value`,
    `--flag value`; a boolean as `-flag` or `-flag=false` (never taking the next argument); parsing stops
    at the first argument that is not a flag, or after `--`. Returns (values by field name, the
    deprecated flags given). Raises FlagError with Go's message; `-h`/`-help` raise HelpRequested."""
    fields = {_flag_name(f)[2:]: f for f in attrs.fields(cls)}
    deprecated = deprecated or {}
    values: dict[str, Any] = {}
    used: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if len(arg) < 2 or arg[0] != "-":
            break
        if arg == "--":
            break
        name = arg[2:] if arg.startswith("--") else arg[1:]
        if not name or name[0] in "-=":
            raise FlagError(f"bad flag syntax: {arg}")
        name, has_value, value = name.partition("=")
        i += 1
        if name in ("h", "help"):
            raise HelpRequested()
        if name in ("config", "version"):
            field = None
        elif name in deprecated:
            field = None
            used.append(name)
        else:
            field = fields.get(name)
            if field is None:
                raise FlagError(f"flag provided but not defined: -{name}")
        if not has_value:
            if _is_bool_flag(field) and name != "config":
                value = "true"
            elif i < len(argv):
                value, i = argv[i], i + 1
            else:
                raise FlagError(f"flag needs an argument: -{name}")
        if field is None:
            if name == "config":
                values["config"] = value
            else:
                try:
                    values[name.replace("-", "_")] = _parse_bool(value)
                except ValueError:
                    raise FlagError(f"invalid boolean value {_go_quote(value)} for -{name}: parse error") from None
            continue
        try:
            converted = _converter(field)(value)
        except ValueError as exc:
            if isinstance(field.default, bool):
                raise FlagError(f"invalid boolean value {_go_quote(value)} for -{name}: parse error") from None
            # Go's flag package says "parse error" for its own kinds; a flag.Value says what it found
            reason = exc if field.metadata.get("kind") in ("log_level", "tls_required") else "parse error"
            raise FlagError(f"invalid value {_go_quote(value)} for flag -{name}: {reason}") from None
        if field.metadata.get("repeat"):
            values.setdefault(field.name, []).append(converted)
        else:
            values[field.name] = converted
    return values, used


class HelpRequested(Exception):
    """-h or -help: print the usage and exit 0, as Go's flag package does."""


def usage(cls: type, daemon: str) -> str:
    """The flag list in the shape Go's flag.PrintDefaults prints it."""
    entries = [("config", "  -config string", "    \tpath to config file"),
               ("version", "  -version", "    \tprint version string")]
    for field in attrs.fields(cls):
        kind = field.metadata.get("kind")
        if field.metadata.get("repeat") or kind in ("log_level", "tls_required"):
            type_name = "value"
        elif _is_bool_flag(field):
            type_name = ""
        elif kind == "duration":
            type_name = "duration"
        elif isinstance(field.default, int):
            type_name = "int"
        else:
            type_name = "string"
        name = _flag_name(field)[2:]
        default = field.default
        if isinstance(default, attrs.Factory) or default in ("", False, 0, 0.0):  # type: ignore[arg-type]
            shown = ""
        elif kind == "duration":
            shown = f" (default {format_duration(default)})"
        elif type_name == "string":
            shown = f" (default {_go_quote(default)})"
        elif kind == "log_level":
            shown = f" (default {str(default).upper()})"
        else:
            shown = f" (default {default})"
        entries.append((name, f"  -{name} {type_name}".rstrip(), f"    \t{field.metadata['help']}{shown}"))
    lines = [f"Usage of {daemon}:"]
    for _, head, text in sorted(entries):
        lines += [head, text]
    return "\n".join(lines) + "\n"


def load_options(
    cls: type, argv: list[str] | None, daemon: str, deprecated: dict[str, str] | None = None
) -> tuple[Any, list[str]]:
    """Flags win over the config file, which wins over the defaults. A command line Go's flag package
    refuses prints Go's message and the usage to stderr and exits 2; -h exits 0; --version prints the
    version line and exits 0. Returns (options, the deprecated flags given, for the caller to log)."""
    import sys

    from trio_nsq.shared.version import version_line

    argv = sys.argv[1:] if argv is None else argv
    try:
        args, used = parse_flags(cls, argv, deprecated)
    except HelpRequested:
        sys.stderr.write(usage(cls, daemon))
        raise SystemExit(0) from None
    except FlagError as exc:
        sys.stderr.write(f"{exc}\n{usage(cls, daemon)}")
        raise SystemExit(2) from None
    if args.pop("version", False):
        print(version_line(daemon))  # the one print: a CLI answering --version
        raise SystemExit(0)
    for name in deprecated or {}:
        args.pop(name.replace("-", "_"), None)
    values: dict[str, Any] = {}
    config_path = args.pop("config", None)
    if config_path:
        try:
            with open(config_path, "rb") as fh:
                raw = tomllib.load(fh)
            values.update(config_values(cls, raw))
        except (OSError, tomllib.TOMLDecodeError, ValueError) as exc:
            sys.stderr.write(f"failed to load config file {config_path} - {exc}\n")
            raise SystemExit(1) from None
    values.update(args)
    for field in attrs.fields(cls):
        if field.metadata.get("kind") == "floats" and field.name in values:
            # as nsqd: every value given, in descending order
            values[field.name] = sorted(_flatten(values[field.name]), reverse=True)
    return cls(**values), used


def config_values(cls: type, raw: dict[str, Any]) -> dict[str, Any]:
    """The option values of a parsed TOML config (go-options' rules); ValueError names a bad key."""
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
            raise ValueError(f"config key {key!r}: {exc}") from None
    return values
