"""`python -m jaxspec` is the `jaxspec` command (see jaxspec/cli/)."""

import sys

from jaxspec.cli import main

sys.exit(main())
