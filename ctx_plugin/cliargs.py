"""Command lines checked without exiting: argparse errors become ``ValueError`` (the launcher checks programs'
arguments before a job is submitted, and a job that fails its checks still writes its status)."""
from __future__ import annotations

import argparse


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
