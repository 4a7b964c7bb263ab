import sys

from momlab.cli import main

sys.exit(main())
