import sys

from jaxserve.cli import main

sys.exit(main())
