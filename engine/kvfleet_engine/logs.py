"""How kvfleet's processes log: one format, the process's role as a prefix (the engine core, a
parallel rank), and torch's own INFO lines (cache statistics printed at exit) left out unless the
level is debug."""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure(level: str, role: str | None = None) -> None:
    """Log at `level` (debug, info, warning...) to stderr, each line prefixed with [role]."""
    prefix = f"[{role}] " if role else ""
    logging.basicConfig(level=level.upper(), format=prefix + FORMAT)
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        logging.getLogger("torch").setLevel(logging.WARNING)
