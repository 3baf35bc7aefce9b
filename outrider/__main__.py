import sys

from outrider.cli import main

sys.exit(main())
