"""``python -m afd_ext <command>``: the same as the ``afd-ext`` command (see :mod:`afd_ext.tools.cli`)."""

import sys

from afd_ext.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
