import sys

from edge0.cli import main

sys.exit(main())
