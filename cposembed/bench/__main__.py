"""``python -m cposembed.bench``: the same as ``python -m cposembed bench``."""

import sys

from . import main

sys.exit(main())
