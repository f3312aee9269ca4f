"""`conveyor serve --config FILE` (and `conveyor batch run`): a YAML file of the command's
options, as vLLM's `--config`.

Each key is an option's long name, with dashes or underscores (`max-model-len: 4096`,
`max_num_seqs: 64`); a switch takes `true` (or `false`: left off, or `--no-NAME` where the option
has that form), a list gives the option's values in turn (an option given once per value,
such as `middleware`, once for each), a mapping is passed as JSON. The file's
options come before the command line's, so an option given on both takes the command line's
value. `model` may be given in the file, on the command line or as the command's first argument.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

CONFIG_OPTION = "--config"


def with_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`argv` (the arguments after the command's name) with the options of the file that
    `--config FILE` names put first; unchanged where there is none."""
    path, rest = _config_path(argv)
    if path is None:
        return argv
    try:
        loaded = _read(Path(path))
    except ValueError as exc:
        parser.error(str(exc))
    options: list[str] = []
    for key, value in loaded.items():
        options += _as_options(parser, path, str(key), value)
    return options + rest


def _config_path(argv: list[str]) -> tuple[str | None, list[str]]:
    """The path `--config` names in `argv` (the last where given twice), and the other
    arguments."""
    path = None
    rest: list[str] = []
    arguments = iter(argv)
    for argument in arguments:
        if argument == CONFIG_OPTION:
            path = next(arguments, None)
            if path is None:
                raise SystemExit(f"{CONFIG_OPTION} needs a file")
        elif argument.startswith(CONFIG_OPTION + "="):
            path = argument.partition("=")[2]
        else:
            rest.append(argument)
    return path, rest


def _read(path: Path) -> dict[Any, Any]:
    import yaml

    try:
        loaded = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ValueError(f"{CONFIG_OPTION} {path}: cannot read the file: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ValueError(f"{CONFIG_OPTION} {path}: not YAML: {exc}") from exc
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ValueError(f"{CONFIG_OPTION} {path}: the file must hold a mapping of options")
    return loaded


def _as_options(parser: argparse.ArgumentParser, path: str, key: str, value: Any) -> list[str]:
    """The command-line arguments of one of the file's options."""
    name = "--" + key.replace("_", "-")
    # argparse keeps its options by name only in this private map
    action = parser._option_string_actions.get(name)
    if action is None or name == CONFIG_OPTION or isinstance(action, argparse._HelpAction):
        parser.error(f"{CONFIG_OPTION} {path}: unknown option '{key}'")
    if action.nargs == 0:  # a switch
        if not isinstance(value, bool):
            parser.error(f"{CONFIG_OPTION} {path}: '{key}' is a switch: give true or false")
        if value:
            return [name]
        negative = "--no-" + name[2:]
        return [negative] if negative in action.option_strings else []
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if isinstance(action, argparse._AppendAction):  # given once per value
        return [part for item in values for part in (name, _as_text(item))]
    return [name, *(_as_text(item) for item in values)]


def _as_text(value: Any) -> str:
    if isinstance(value, dict):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
