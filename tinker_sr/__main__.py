import sys

from tinker_sr.cli import main

sys.exit(main())
