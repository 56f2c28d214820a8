"""`python -m joader.server` runs joaderd."""

import sys

from joader.server.main import main

sys.exit(main())
