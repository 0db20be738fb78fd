import sys

from graphflow.cli import main

sys.exit(main())
