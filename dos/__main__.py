import sys

from dos.lab.cli import main

sys.exit(main())
