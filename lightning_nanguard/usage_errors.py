"""Configuration errors as command-line usage errors under LightningCLI (jsonargparse).

jsonargparse checks types while it parses, but our ranges are checked when the section dataclasses are
built, which LightningCLI does after parsing: a :class:`~.config.ConfigError` raised there surfaced as a
traceback of a hundred lines. While a jsonargparse parser instantiates the callback or one of its
sections, :func:`usage_errors` turns the error into that command line's own usage error (``usage: ...``
and one ``error: ...`` line naming the key, exit code 2; an ``ArgumentError`` with
``exit_on_error=False``), like a value jsonargparse refuses itself. Anywhere else the ``ConfigError``
propagates as is. jsonargparse is never imported here: it is only looked for where it is already in use.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from types import FrameType
from typing import Iterator, Optional

from .errors import ConfigError

__all__ = ["usage_errors"]


def _command_line_parser() -> Optional[argparse.ArgumentParser]:
    """The jsonargparse parser of the command line being parsed or instantiated, if any.

    A section is built under one of jsonargparse's inner parsers (one per class, ``exit_on_error=False``,
    whose errors jsonargparse folds into a multi-line union error that LightningCLI does not catch); the
    command line's own parser is then the outermost parser on the stack.
    """
    common = sys.modules.get("jsonargparse._common")
    context = getattr(common, "parent_parser", None)
    parser = context.get() if context is not None else None
    if parser is None or not callable(getattr(parser, "error", None)):
        return None
    if not getattr(parser, "_inner_parser", False):
        return parser
    base = getattr(sys.modules.get("jsonargparse"), "ArgumentParser", None)
    outer = None
    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None and base is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, base) and not getattr(owner, "_inner_parser", False):
            outer = owner
        frame = frame.f_back
    return outer


@contextmanager
def usage_errors() -> Iterator[None]:
    """Re-raise a ConfigError as the usage error of the jsonargparse command line being instantiated;
    without one, the ConfigError propagates."""
    try:
        yield
    except ConfigError as err:
        parser = _command_line_parser()
        if parser is not None:
            parser.error(f"NaNGuard init_args: {err}")
        raise
