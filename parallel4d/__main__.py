import sys

from parallel4d.tools.cli import main

sys.exit(main())
