"""`python -m river_gguf.cli`: the `river-gguf` command."""
import sys

from . import main

sys.exit(main())
