"""``python -m distgrad.config --yaml | --markdown | --write | --check`` (see :mod:`distgrad.config.generate`)."""

import sys

from distgrad.config.generate import main

sys.exit(main())
