"""``python -m torchtune_ext.parity_report``: see :mod:`torchtune_ext.tools.parity_report.cli`."""

import sys

from torchtune_ext.tools.parity_report.cli import main

sys.exit(main())
