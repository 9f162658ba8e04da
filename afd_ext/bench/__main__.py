"""``python -m afd_ext.bench``: same as ``afd-ext bench``."""

import sys

from afd_ext.bench import main

if __name__ == "__main__":
    sys.exit(main())
