"""``python -m engine``: the ``engine`` command, for environments whose scripts directory is not on
``PATH`` (a project ``.venv`` not activated, ``pip install --user``, an embedded interpreter)."""

import sys

from engine.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
