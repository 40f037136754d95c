"""``python -m tcoll``: the tcoll command line (see `tcoll.cli`)."""

import sys

from tcoll.cli import main

if __name__ == "__main__":
    sys.exit(main())
