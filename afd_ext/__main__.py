"""``python -m afd_ext <command>``: the same as the ``afd-ext`` command (see :mod:`afd_ext.cli`)."""

import sys

from afd_ext.cli import main

if __name__ == "__main__":
    sys.exit(main())
