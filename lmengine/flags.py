"""Command-line flags shared by the `lmengine` commands and `lmengine serve`.

Engine and generation flags are generated from the `EngineConfig` and `GenerationConfig`
dataclasses (help text from their field comments), so the flags and the configs never drift.
Flags that name files and folders are checked before anything is loaded: a missing or
unreadable path is a `FlagError`, one line naming the flag and the path.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

from lmengine.config import PYTHON_ONLY_FIELDS, EngineConfig


class FlagError(ValueError):
    """A flag value a command cannot use (a missing file, an unreadable folder, a model that
    does not load). Its message is one line naming the flag and the value; the command line
    prints it and exits with status 2. It never carries a traceback to the user."""


def one_line(err: BaseException | str) -> str:
    """An error message on one line (the lines of a multi-line library message joined)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return " ".join(lines) or type(err).__name__


# ---- flags from dataclasses ---------------------------------------------------------------------
def field_help(cls) -> dict[str, str]:
    """`name: type = default  # help` comments of a dataclass, by field name."""
    helps = {}
    for line in inspect.getsource(cls).splitlines():
        m = re.match(r"\s+(\w+):[^#]*=[^#]*#\s*(.+)$", line)
        if m:
            helps[m.group(1)] = m.group(2).strip()
    return helps


def name_value(text: str) -> tuple[str, str]:
    """One `NAME=VALUE` item of a mapping flag (an argparse `type`)."""
    name, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, value


def parse_mapping(items: list) -> dict[str, str]:
    """`NAME=VALUE` items (or pairs already split) as a dict."""
    return dict(item if isinstance(item, tuple) else name_value(item) for item in items)


def add_dataclass_flags(parser: argparse.ArgumentParser, cls, title: str, defaults=None) -> None:
    """One flag per dataclass field, `--field-name`, typed from the annotation."""
    group = parser.add_argument_group(title)
    helps = field_help(cls)
    defaults = defaults or {}
    for f in dataclasses.fields(cls):
        if f.name in PYTHON_ONLY_FIELDS:
            continue
        flag = "--" + f.name.replace("_", "-")
        ann = str(f.type)
        default = defaults.get(f.name, f.default)
        if default is dataclasses.MISSING:  # a default_factory field
            default = f.default_factory()
        text = helps.get(f.name, "")
        text = f"{text} (default: {default})" if text else f"default: {default}"
        kwargs = dict(dest=f"{cls.__name__}.{f.name}", default=None, help=text)
        if ann.startswith("bool"):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        elif ann.startswith("list[int]"):
            group.add_argument(flag, nargs="+", type=int, metavar="ID", **kwargs)
        elif ann.startswith("list[str]"):
            group.add_argument(flag, nargs="+", metavar="TEXT", **kwargs)
        elif ann.startswith("dict"):
            group.add_argument(flag, nargs="+", type=name_value, metavar="NAME=PATH", **kwargs)
        elif ann.startswith("int"):
            group.add_argument(flag, type=int, **kwargs)
        elif ann.startswith("float"):
            group.add_argument(flag, type=float, **kwargs)
        else:
            group.add_argument(flag, type=str, **kwargs)


def build_dataclass(cls, args: argparse.Namespace, defaults=None):
    """The dataclass from parsed flags; unset flags keep the dataclass (or given) defaults."""
    values = dict(defaults or {})
    prefix = cls.__name__ + "."
    types = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    for key, value in vars(args).items():
        if key.startswith(prefix) and value is not None:
            name = key[len(prefix) :]
            if isinstance(value, list) and types[name].startswith("dict"):
                value = parse_mapping(value)
            values[name] = value
    return cls(**values)


def add_model_flags(parser: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    """`--model` and one flag per `EngineConfig` field (`defaults`: a command's own)."""
    parser.add_argument(
        "--model",
        default=None,
        help="checkpoint folder, hub id or .gguf file (default: SmolLM2-135M-Instruct)",
    )
    add_dataclass_flags(parser, EngineConfig, "engine options", defaults)


# ---- paths named by flags -----------------------------------------------------------------------
def check_file(flag: str, value: str) -> None:
    """A file to read: it exists, is a file (not a folder) and opens."""
    path = Path(value)
    if not path.exists():
        raise FlagError(f"{flag}: no such file: {value}")
    if not path.is_file():
        raise FlagError(f"{flag}: not a file: {value}")
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise FlagError(f"{flag}: cannot read {value}: {e.strerror or e}") from None


def check_folder(flag: str, value: str) -> None:
    """A folder to read (a peft adapter): it exists, is a folder and lists."""
    path = Path(value)
    if not path.exists():
        raise FlagError(f"{flag}: no such folder: {value}")
    if not path.is_dir():
        raise FlagError(f"{flag}: not a folder: {value}")
    try:
        os.listdir(path)
    except OSError as e:
        raise FlagError(f"{flag}: cannot read {value}: {e.strerror or e}") from None


def check_output_file(flag: str, value: str) -> None:
    """A file to write: its folder exists (checked up front, not after the work is done)."""
    path = Path(value)
    if path.is_dir():
        raise FlagError(f"{flag}: is a folder: {value}")
    folder = path.parent
    if not folder.is_dir():
        raise FlagError(f"{flag}: no such folder: {folder} (for {value})")


def looks_local(value: str) -> bool:
    """A model value that can only be a local path, never a hub id ("org/name")."""
    return (
        os.path.isabs(value)
        or value.startswith(("./", "../", "~"))
        or value in (".", "..")
        or value.endswith(".gguf")
        or value.count("/") > 1
    )


def check_model(flag: str, value: str | None) -> None:
    """A model: an existing checkpoint folder or .gguf file, or something shaped like a hub
    id (left to the loader). None or "" is the default model."""
    if not value:
        return
    path = Path(value)
    if path.is_dir():
        check_folder(flag, value)
        return
    if path.is_file():
        if path.suffix != ".gguf":
            raise FlagError(f"{flag}: not a checkpoint folder or .gguf file: {value}")
        check_file(flag, value)
        return
    if path.exists():
        raise FlagError(f"{flag}: not a checkpoint folder or .gguf file: {value}")
    if looks_local(value):
        raise FlagError(f"{flag}: no such checkpoint folder or file: {value}")


def _draft_model(speculative: str) -> str | None:
    """The draft model a `--speculative` JSON names (None: none, or not valid JSON, which
    EngineConfig reports itself)."""
    try:
        spec = json.loads(speculative)
    except json.JSONDecodeError:
        return None
    draft = spec.get("draft_model") if isinstance(spec, dict) else None
    return draft if isinstance(draft, str) else None


# flag dest -> what its value names
PATH_KINDS = {
    "model": "model",
    "model_path": "model",
    "prompt_file": "file",
    "calib_file": "file",
    "chat_template": "file",
    "lora_root": "folder",
    "EngineConfig.qos_config_path": "file",
    "EngineConfig.adapters": "adapters",
    "EngineConfig.speculative": "speculative",
    "jsonl": "output",
    "json": "output",
}


def check_path_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Raise FlagError for the first flag of `parser` (in help order) naming a path that is
    missing or unreadable. Run before anything is loaded."""
    for action in parser._actions:
        kind = PATH_KINDS.get(action.dest)
        value = getattr(args, action.dest, None)
        if kind is None or value is None:
            continue
        flag = action.option_strings[0] if action.option_strings else action.metavar
        flag = flag or action.dest.upper()
        if kind == "model":
            check_model(flag, value)
        elif kind == "file":
            check_file(flag, value)
        elif kind == "output":
            check_output_file(flag, value)
        elif kind == "folder":
            check_folder(flag, value)
        elif kind == "adapters":
            for name, folder in parse_mapping(value).items():
                check_folder(f"{flag} {name}", folder)
        elif kind == "speculative":
            draft = _draft_model(value)
            if draft is not None:
                check_model(f"{flag} draft_model", draft)


@contextlib.contextmanager
def model_load_errors(
    model: str | None, engine_config: EngineConfig | None = None
) -> Iterator[None]:
    """Turn the loader's OSError (hub unreachable, repository not found, missing files) into a
    one-line FlagError naming the model (and the speculative draft model, if any)."""
    try:
        yield
    except OSError as e:
        name = repr(model) if model else "the default model"
        spec = engine_config.speculative if engine_config is not None else None
        draft = getattr(spec, "draft_model", None)
        if draft:
            name += f" or its draft model {draft!r}"
        raise FlagError(f"cannot load the model {name}: {one_line(e)}") from None
