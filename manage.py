#!/usr/bin/env python
"""Django's command-line utility for the serving platform's control plane.

Puts ``platform/`` (the Django source folder; deliberately NOT a package, so it never hides the
standard library's ``platform`` module) and the repository root (for ``inference``) on ``sys.path``
and defaults ``DJANGO_SETTINGS_MODULE`` to ``config.settings``.
"""

import os
import sys
from pathlib import Path

ROOT_DIR = Path(__file__).resolve().parent


def _sys_path_setup() -> None:
    """Put ``platform/`` first and the repository root second on ``sys.path`` (idempotent)."""
    for index, path in enumerate((ROOT_DIR / "platform", ROOT_DIR)):
        text = str(path)
        if text in sys.path:
            sys.path.remove(text)
        sys.path.insert(index, text)


def main() -> None:
    """Run a Django management command (``python manage.py <command> ...``)."""
    _sys_path_setup()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
