import sys

from dos.cli import main

sys.exit(main())
