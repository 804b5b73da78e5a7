"""Command-line entry point: `python -m functrain.main --config=configs/gpt.py[:variant]`.

Flags:
  --config       an ml_collections config file (`get_config(variant)`); `path:variant` picks a
                 variant; `--config.a.b=value` overrides any key (unknown keys are rejected).
  --workdir      run directory (default: runs/<config name>[-<variant>]).

Bad input (unknown config key, bad value, missing data path) ends the program with one line
`functrain: error: ...` naming the problem and the fix, and exit status 2.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

_DEFAULT_CONFIG = str(Path(__file__).resolve().parent.parent / "configs" / "gpt.py")

_CONFIG = config_flags.DEFINE_config_file(
    "config", _DEFAULT_CONFIG, "Config file, optionally with ':variant'.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (default: runs/<config>[-<variant>]).")


def _fail(message: str) -> None:
    """Prints one error line and exits with status 2."""
    print(f"functrain: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def _explain_flag_error(exc: Exception, argv: list[str]) -> str:
    """One readable line for a flag-parsing failure."""
    text = str(exc).strip()
    if len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":  # a quoted message
        text = text[1:-1]
    if isinstance(exc, AttributeError):
        text = text.replace("\\'", "'").replace("\\n", " ")
        hint = re.search(r'Did you mean "(\w+)" instead of "(\w+)"', text)
        key = hint.group(2) if hint else (re.findall(r"(\w+)", text) or [""])[0]
        bad = next((a for a in argv if a.startswith("--config.") and key and key in a.split("=")[0]), None)
        msg = f"unknown config key {bad.split('=')[0] if bad else key!r}"
        if hint:
            msg += f" (did you mean {hint.group(1)!r}?)"
        return msg + "; the valid keys are in the config file's get_config()"
    if isinstance(exc, flags.UnrecognizedFlagError):
        return f"{text}; run with --helpfull to list the flags"
    return text.splitlines()[0]


def _parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing that turns every failure into one clear line."""
    try:
        return flags.FLAGS(argv)
    except Exception as exc:  # noqa: BLE001 - every flag error becomes one line
        _fail(_explain_flag_error(exc, argv))
    return []


def _default_workdir(config_arg: str) -> str:
    """runs/<config file stem>[-<variant>]."""
    path, _, variant = config_arg.partition(":")
    name = Path(path).stem + (f"-{variant}" if variant else "")
    return str(Path("runs") / name)


def main(argv: list[str]) -> None:
    """Loads the config and runs `functrain.train.train`."""
    del argv
    from functrain.checkpoint import CheckpointError
    from functrain.data import DataError
    from functrain.train import TrainingError, train

    try:
        config = _CONFIG.value
    except Exception as exc:  # noqa: BLE001 - a config file that fails to load
        first = str(exc).splitlines()
        _fail(f"cannot load --config: {' '.join(l.strip() for l in first[:4])}")
    workdir = _WORKDIR.value or _default_workdir(flags.FLAGS["config"].serialize().split("=", 1)[-1])
    try:
        train(config, workdir)
    except (CheckpointError, DataError, TrainingError) as exc:
        _fail(str(exc))


def run() -> None:
    """Console-script entry point."""
    app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
    run()
