"""Command-line checking. :func:`parse_strict`: argparse errors become ``ValueError`` (the launcher checks programs'
arguments before a job is submitted, and a job that fails its checks still writes its status). The ``type=``
functions (:func:`positive_int`, :func:`tokens`, :func:`output_file`, ...) reject a bad value while argparse parses,
before any work, and :class:`OneLineParser` reports it as one line (``ctx-plugin <command>: error: ...``)."""
from __future__ import annotations

import argparse
import json
import os
from decimal import Decimal, InvalidOperation
from pathlib import Path


def parse_strict(parser: argparse.ArgumentParser, argv: list[str], *, required: tuple[str, ...] = (),
                 what: str = "") -> argparse.Namespace:
    """``parser.parse_args(argv)`` that raises ``ValueError`` for a bad value, an unknown argument, a missing
    option of ``required`` (destination names; argparse's own ``required=True`` exits instead) or ``-h``."""
    prefix = f"{what}: " if what else ""
    if any(a in ("-h", "--help") for a in argv):
        raise ValueError(f"{prefix}-h/--help asks for the usage, not a run: drop it")
    try:
        args, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise ValueError(f"{prefix}{e}") from None
    if unknown:
        raise ValueError(f"{prefix}unrecognized arguments: {' '.join(unknown)}")
    missing = [f"--{name.replace('_', '-')}" for name in required if getattr(args, name) is None]
    if missing:
        raise ValueError(f"{prefix}{', '.join(missing)} is required")
    return args


def option_value(argv: list[str], flag: str) -> str | None:
    """The value given to ``flag`` in ``argv`` (``--flag value`` or ``--flag=value``), before any ``--``."""
    for i, a in enumerate(argv):
        if a == "--":
            break
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a[len(flag) + 1:]
    return None


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr, ``<prog>: error: <message>``, exit status 2 (no
    usage block, no traceback). ``add_subparsers`` makes its sub-parsers of the same class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(str(message).split())}\n")


def _number(text: str, kind: str) -> Decimal:
    try:
        value = Decimal(text.strip())
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give {kind}") from None
    if not value.is_finite():
        raise argparse.ArgumentTypeError(f"{text!r} is not finite; give {kind}")
    return value


def positive_int(text: str) -> int:
    """An ``int`` ≥ 1 (no fraction, no rounding)."""
    value = _number(text, "a whole number ≥ 1")
    if value != value.to_integral_value() or value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number ≥ 1; give e.g. 1, 2 or 8")
    return int(value)


def random_seed(text: str) -> int:
    """A random seed: a whole number in 0..2⁶³−1 (torch takes seeds below 2⁶⁴; the trainers add each rank's
    index)."""
    value = _number(text, "a whole number in 0..2^63-1")
    if value != value.to_integral_value() or not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"{text!r} is not a seed: give a whole number in 0..2^63-1")
    return int(value)


def positive_float(text: str) -> float:
    """A finite ``float`` > 0."""
    value = _number(text, "a finite number > 0")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return float(value)


def nonnegative_float(text: str) -> float:
    """A finite ``float`` ≥ 0."""
    value = _number(text, "a finite number ≥ 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be ≥ 0")
    return float(value)


def tokens(text: str) -> int:
    """A whole, positive number of tokens: ``131072``, ``128k`` (×1024) or ``1m`` (×1024²); nothing rounded."""
    stripped = text.strip().lower()
    scale = {"k": 1024, "m": 1024 ** 2}.get(stripped[-1:], 1)
    value = _number(stripped[:-1] if scale > 1 else stripped, "a token count such as 131072 or 128k") * scale
    if value != value.to_integral_value() or value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens ≥ 1; give e.g. 4096 or 128k")
    if value > MAX_TOKENS:
        raise argparse.ArgumentTypeError(f"{text!r} is more than {MAX_TOKENS:,} tokens (2⁴⁰), beyond any sequence a "
                                         f"cluster holds; give e.g. 4096, 128k or 16m")
    return int(value)


MAX_TOKENS = 2 ** 40
"""The largest token count the command-line tools take (their arithmetic and plans stay meaningful below it)."""


def non_negative_tokens(text: str) -> int:
    """A whole number of tokens ≥ 0, spelled as :func:`tokens` reads them (``4096``, ``4k``):
    the window's size (``0``: each query sees only itself, ``window=(0, 0)``)."""
    try:
        return tokens(text)
    except argparse.ArgumentTypeError:
        stripped = text.strip().lower()
        try:
            if Decimal(stripped[:-1] if stripped[-1:] in ("k", "m") else stripped) == 0:
                return 0
        except InvalidOperation:
            pass
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens ≥ 0 (0: each query sees only "
                                         f"itself); give e.g. 0, 4096 or 4k") from None


def output_file(text: str) -> str:
    """A path a file can be written to: its folder exists and is writable, and it is not a folder itself."""
    path = Path(text)
    folder = path.parent
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file name in it")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"folder {str(folder)!r} does not exist; create it or write elsewhere")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text} is not writable; write elsewhere")
    return text


def read_json_object(text: str) -> dict:
    """The JSON object (``dict``) stored in the file ``text``; ``ArgumentTypeError`` naming what is wrong."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder, not a JSON file")
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {text} ({e.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise argparse.ArgumentTypeError(f"{text} is not JSON ({e})") from None
    if not isinstance(data, dict):
        raise argparse.ArgumentTypeError(f"{text} holds a JSON {type(data).__name__}, not an object "
                                         f"({{\"key\": value, ...}})")
    return data


def without_option(argv: list[str], flag: str) -> list[str]:
    """``argv`` without ``flag`` and its value (``--flag value`` or ``--flag=value``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out
