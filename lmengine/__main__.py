"""`python -m lmengine` is the `lmengine` command."""

import sys

from lmengine.cli import main

sys.exit(main())
