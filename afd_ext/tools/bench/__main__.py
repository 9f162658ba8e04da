"""``python -m afd_ext.tools.bench``: same as ``afd-ext bench``."""

import sys

from afd_ext.tools.bench import main

if __name__ == "__main__":
    sys.exit(main())
