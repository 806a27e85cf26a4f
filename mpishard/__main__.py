"""``python -m mpishard`` is the ``mpishard`` command."""
import sys

from .cli import main

sys.exit(main())
