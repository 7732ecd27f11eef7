"""`python -m posttrain` is the `posttrain` command."""

import sys

from posttrain.cli import main

sys.exit(main())
